#!/usr/bin/env python3
"""List the ExecuTorch operators the parity zoo lowers to (portable, no delegate).

    /root/.cache/etmetal/venv/bin/python scripts/survey_pte_ops.py [--dtype f32|bf16] [--schemas]

Each zoo module (tests/parity/zoo.py) goes through
`to_edge(torch.export.export(m, inputs)).to_executorch()`; the operator table
of the resulting program is what `etmetal-pte`'s `kernels::decode` must read.
`--schemas` also prints each out-variant's ATen schema (the argument order
decode follows).
"""

import argparse
import os
import sys

import torch
from executorch.exir import to_edge

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
import zoo  # noqa: E402


def operators(module, inputs):
    prog = to_edge(torch.export.export(module, inputs)).to_executorch()
    plan = prog.executorch_program.execution_plan[0]
    return {(op.name, op.overload) for op in plan.operators}


def schema(name, overload):
    ns, op = name.split("::")
    packet = getattr(getattr(torch.ops, ns), op)
    return str(getattr(packet, overload or "default")._schema)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    ap.add_argument("--schemas", action="store_true")
    args = ap.parse_args()
    union, failed = {}, []
    for case in zoo.CASES:
        if args.dtype not in case.dtypes:
            continue
        module, inputs = zoo.instantiate(case, args.dtype)
        try:
            ops = operators(module, inputs)
        except Exception as e:  # report every module, not only the first failure
            failed.append(f"{case.name}: {type(e).__name__}: {e}")
            continue
        for op in ops:
            union.setdefault(op, []).append(case.name)
        print(f"{case.name}: {' '.join(sorted(f'{n}.{o}' for n, o in ops))}")
    print(f"\n{len(union)} operators:")
    for (name, overload), users in sorted(union.items()):
        line = f"  {name}.{overload}  ({len(users)} modules)"
        if args.schemas:
            line += f"\n      {schema(name, overload)}"
        print(line)
    for f in failed:
        print("export failed:", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
