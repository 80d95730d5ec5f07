#!/bin/sh
# Writes the files the dev-cpu overlay's secretGenerator reads, under secrets/ next to this
# script (git-ignored): a development CA, one server certificate naming the coordinator's and
# both worker Services' DNS names in namespace specdec-dev (and localhost and 127.0.0.1, for
# port-forwards), the coordinator's client certificate — all made by `specdec certs` — and one
# random bearer token. Files already there are kept; delete secrets/ to start over.
#
#   k8s/overlays/dev-cpu/make-secrets.sh                        # `specdec` installed here
#   SPECDEC="python -m specdec" k8s/overlays/dev-cpu/make-secrets.sh
#   docker run --rm -u "$(id -u)" -v "$PWD/k8s/overlays/dev-cpu:/w" --entrypoint sh \
#       specdec:0.1.0-cpu /w/make-secrets.sh                    # with the image alone
set -eu

here=$(cd "$(dirname "$0")" && pwd)
out="$here/secrets"
namespace=specdec-dev
specdec=${SPECDEC:-specdec}

mkdir -p "$out"
if [ ! -s "$out/ca.pem" ]; then
    # Word splitting of $specdec is wanted: SPECDEC may be a command with arguments.
    # shellcheck disable=SC2086
    $specdec certs --out "$out" \
        --host "specdec-coordinator.$namespace.svc" \
        --host "specdec-coordinator.$namespace.svc.cluster.local" \
        --host "specdec-coordinator.$namespace" \
        --host specdec-coordinator \
        --host "specdec-target-worker.$namespace.svc" \
        --host "specdec-draft-worker.$namespace.svc"
fi
if [ ! -s "$out/tokens" ]; then
    (
        umask 077
        head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$out/tokens"
        echo >> "$out/tokens"
    )
fi
echo "dev-cpu secrets in $out: CA ca.pem, bearer token in tokens"
