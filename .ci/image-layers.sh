#!/bin/bash
# The layer that differs between nodecomm's images, /opt/nodecomm, built with the Dockerfile's own
# steps outside a container (no container builder or registry here): `image-layers.sh NAME:REV...`
# (REV a commit of this repository) builds REV's venv into /tmp/img/NAME (kernels for sm_90 only)
# and prints its size (apparent bytes, `du -sb`), as a tar, and gzipped (as a registry stores it).
# A REV whose base dependencies require torch gets the Dockerfile's `pip install torch` first, from
# PyPI (the CUDA build), as its image did.
set -eo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
W=/tmp/img
for spec in "$@"; do
  name=${spec%%:*} rev=${spec#*:}
  [[ "$name" =~ ^[A-Za-z0-9_-]+$ && -n "$rev" && "$spec" == *:* ]] || { echo "expected NAME:REV, got '$spec'" >&2; exit 2; }
  rm -rf "${W:?}/$name" "${W:?}/$name-src" && mkdir -p "$W/$name-src"
  git archive "$rev" | tar -x -C "$W/$name-src"
  python3 -m venv "$W/$name/opt/nodecomm"
  pip=$W/$name/opt/nodecomm/bin/pip
  needs_torch=$(python3 -c 'import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(any(d.replace(" ", "").lower().startswith(("torch>", "torch=", "torch<", "torch;")) or d.strip() == "torch" for d in deps))' \
    "$W/$name-src/pyproject.toml")
  if [ "$needs_torch" = True ]; then
    (unset PIP_FIND_LINKS; $pip install -q --isolated --cert /etc/ssl/certs/ca-certificates.crt --no-cache-dir torch)
  fi
  (cd "$W/$name-src" && NODECOMM_CUDA_ARCHS=90 $pip install -q --no-cache-dir .)
  "$W/$name/opt/nodecomm/bin/python" -P -c "from nodecomm import _native; assert _native.WITH_CUDA"
  echo "$name ($rev): $(du -sb "$W/$name/opt/nodecomm" | cut -f1) bytes (du -sb)," \
    "tar $(tar -C "$W/$name" -cf - opt | wc -c), gzip -6 $(tar -C "$W/$name" -cf - opt | gzip -6 | wc -c)"
done
