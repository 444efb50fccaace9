#!/bin/bash
# The layer that differs between nodecomm's images, /opt/nodecomm, built with the Dockerfile's own
# steps outside a container (no container builder or registry here): `image-layers.sh NAME:REV...`
# builds REV's venv into /tmp/img/NAME (kernels for sm_90 only) and prints its size on disk, as a
# tar and gzipped (what a registry stores). A REV whose pyproject.toml requires torch gets the
# Dockerfile's `pip install torch` first, from PyPI (the CUDA build), as its image did.
set -e
W=/tmp/img
for spec in "$@"; do
  name=${spec%%:*} rev=${spec##*:}
  rm -rf "$W/$name" "$W/$name-src" && mkdir -p "$W/$name-src"
  git archive "$rev" | tar -x -C "$W/$name-src"
  python3 -m venv "$W/$name/opt/nodecomm"
  pip=$W/$name/opt/nodecomm/bin/pip
  if grep -qE '^\s*"torch' "$W/$name-src/pyproject.toml" && ! grep -q '^client = ' "$W/$name-src/pyproject.toml"; then
    (unset PIP_FIND_LINKS; $pip install -q --isolated --cert /etc/ssl/certs/ca-certificates.crt --no-cache-dir torch)
  fi
  (cd "$W/$name-src" && NODECOMM_CUDA_ARCHS=90 $pip install -q --no-cache-dir .)
  "$W/$name/opt/nodecomm/bin/python" -P -c "from nodecomm import _native; assert _native.WITH_CUDA"
  echo "$name ($rev): $(du -sb "$W/$name/opt/nodecomm" | cut -f1) bytes on disk," \
    "tar $(tar -C "$W/$name" -cf - opt | wc -c), gzip -6 $(tar -C "$W/$name" -cf - opt | gzip -6 | wc -c)"
done
