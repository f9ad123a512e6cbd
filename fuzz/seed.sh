#!/usr/bin/env bash
# Copy the repository's fixtures into the fuzz corpora (run from anywhere).
# The copies are not committed: corpus/ is in fuzz/.gitignore.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
mkdir -p "$here/corpus/pte_load" "$here/corpus/pt2_import" "$here/corpus/payload_decode"
cp "$root"/crates/etmetal-pte/tests/fixtures/*.pte "$here/corpus/pte_load/"
cp "$root"/tests/fixtures/*.pt2 "$root"/tests/fixtures/*/*.pt2 "$here/corpus/pt2_import/"
# The malformed corpus (tests/malformed/) sits next to the valid files.
cp "$root"/tests/malformed/pte/*.pte "$here/corpus/pte_load/"
cp "$root"/tests/malformed/pt2/*.pt2 "$here/corpus/pt2_import/"
cp "$root"/tests/malformed/payload/*.emtl "$here/corpus/payload_decode/"
echo "seeded: $(ls "$here/corpus/pte_load" | wc -l) .pte, $(ls "$here/corpus/pt2_import" | wc -l) .pt2," \
  "$(ls "$here/corpus/payload_decode" | wc -l) payloads"
