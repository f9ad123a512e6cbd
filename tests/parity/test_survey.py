"""The survey (`survey.py`): torchvision classification models, transformers
architectures from small configs and timm models, exported as users do,
compiled with `--backend metal`, run on this machine's adapter (Mesa's
software Vulkan in CI) and compared with eager in f32 (max abs err <= 1e-4 x
max |eager|). Each must run delegated to the GPU, with no node on the CPU
unless its entry states why (then every CPU node's reason must say so).

CI runs the fast subset (`survey.FAST`); the whole survey:

    ETMETAL_SURVEY=full scripts/run-parity.sh -k test_survey
"""

from __future__ import annotations

import os

import pytest

import survey

FULL = os.environ.get("ETMETAL_SURVEY") == "full"
SELECTED = [e for e in survey.entries() if FULL or e.fast]


@pytest.mark.parametrize("entry", SELECTED, ids=[e.name for e in SELECTED])
def test_survey(entry, etmetal_gpu, tmp_path):
    out = survey.check(entry, etmetal_gpu.binary, tmp_path)
    row = out.row(entry.name)
    assert out.stage == "ok", f"{row}\n{out.error}"
    assert out.partitions > 0 and out.ran_on_gpu, f"nothing ran on a GPU\n{row}"
    if entry.cpu_reason is None:
        assert out.cpu == 0, f"nodes left on the cpu: {out.cpu_reasons}\n{row}"
    else:
        other = [r for r in out.cpu_reasons if entry.cpu_reason not in r]
        assert not other, f"cpu nodes for other reasons than `{entry.cpu_reason}`: {other}\n{row}"


def test_fast_subset_names_real_entries():
    names = {e.name for e in survey.entries()}
    assert survey.FAST <= names, survey.FAST - names
