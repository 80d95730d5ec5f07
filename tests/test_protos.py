"""The contract: generated stubs are current, and every rpc and field is documented."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from specdec import codegen


def test_generated_stubs_are_not_stale():
    with tempfile.TemporaryDirectory() as tmp:
        fresh = codegen.generate(Path(tmp))
        for path in fresh:
            committed = codegen.REPO_ROOT / path.relative_to(tmp)
            assert committed.exists(), f"{committed} missing: run python -m specdec.codegen"
            assert committed.read_text() == path.read_text(), f"{committed} is stale: run python -m specdec.codegen"


def test_every_rpc_and_field_has_a_comment():
    for proto in codegen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*(rpc \w+|(optional |repeated )?[\w.]+ \w+ = \d+;)", line) and "UNSPECIFIED" not in line:
                documented = lines[i - 1].strip().startswith("//") or "//" in line
                assert documented, f"{proto.name}:{i + 1} undocumented: {line.strip()}"
