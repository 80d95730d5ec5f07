"""The kinds of draft `specdec distill` trains, each a Student (base.Student) that the
training loop drives without knowing which it is:

    base.py    the Student protocol and the loss a step returns
    model.py   --kind model: a small standalone causal LM over the target's vocabulary
    eagle.py   --kind eagle: a feature-level head reading the target's hidden states
"""
