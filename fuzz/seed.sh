#!/usr/bin/env bash
# Copy the repository's fixtures into the fuzz corpora (run from anywhere).
# The copies are not committed: corpus/ is in fuzz/.gitignore.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
mkdir -p "$here/corpus/pte_load" "$here/corpus/pt2_import"
cp "$root"/crates/etmetal-pte/tests/fixtures/*.pte "$here/corpus/pte_load/"
cp "$root"/tests/fixtures/*.pt2 "$here/corpus/pt2_import/"
echo "seeded: $(ls "$here/corpus/pte_load" | wc -l) .pte, $(ls "$here/corpus/pt2_import" | wc -l) .pt2"
