"""The ExecuTorch plug-in: `EtMetalPartitioner` and `EtMetalBackend`.

Both hand the program to etmetal's Rust compiler as the `.pt2` bytes that
`torch.export.save` writes. ExecuTorch's edge dialect differs from what the
importer reads only in its targets, so they are rewritten to ATen for the
save and put back after (`_pt2_bytes`): edge op → its ATen overload,
`*_copy` view variants → the view op, `dim_order_ops` → `_to_copy` / `clone`
/ `empty` (a dim order changes the memory layout, never the values).
"""

from __future__ import annotations

import io
import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data
from executorch.exir.delegate import executorch_call_delegate
from torch._export.verifier import Verifier
from torch.export import ExportedProgram

from . import _etmetal

# Named data (GPU weights) is page-aligned, as `etmetal compile` writes it
# (Apple's 16 KiB pages), so a runtime can map it without copying.
WEIGHT_ALIGNMENT = 16 << 10

METHOD_NAME_KEY = "method_name"
# Compile specs of the partitioner, as the CLI's `--partition` and `--skip-op`.
PARTITION_KEY = "partition"
SKIP_OP_KEY = "skip_op"
QUANTIZE_KEY = "quantize"
QUANTIZE_SKIP_KEY = "quantize_skip"


def _drop(kwargs: dict, *keys: str) -> dict:
    return {k: v for k, v in kwargs.items() if k not in keys}


def _aten_call(target, args: tuple, kwargs: dict):
    """The ATen `(target, args, kwargs)` of an edge-dialect call; None when
    the target needs no rewrite (ATen already, `getitem`) or has no ATen
    form (the importer then names it)."""
    op = getattr(target, "_op", target)  # EdgeOpOverload wraps the OpOverload
    if not isinstance(op, torch._ops.OpOverload):
        return None
    namespace, name = op._schema.name.split("::")
    overload = op._overloadname
    if namespace == "dim_order_ops":
        if name == "_to_dim_order_copy":
            return torch.ops.aten._to_copy.default, args, _drop(kwargs, "dim_order")
        if name == "_clone_dim_order":
            return torch.ops.aten.clone.default, args, _drop(kwargs, "dim_order", "non_blocking")
        if name == "_empty_dim_order":
            return torch.ops.aten.empty.memory_format, args, _drop(kwargs, "dim_order")
        return None
    if namespace == "aten" and name.endswith("_copy") and name != "lift_fresh_copy":
        view = getattr(torch.ops.aten, name[: -len("_copy")], None)
        if view is not None and overload in view.overloads():
            return getattr(view, overload), args, kwargs
    return (op, args, kwargs) if op is not target else None


def _pt2_bytes(ep: ExportedProgram) -> bytes:
    """`ep` saved with `torch.export.save`, edge targets rewritten to ATen."""
    changed = []
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        call = _aten_call(node.target, node.args, dict(node.kwargs))
        if call is None:
            continue
        changed.append((node, node.target, node.args, node.kwargs))
        node.target, node.args, node.kwargs = call
    # the edge verifier (save validates) would refuse the ATen targets; an
    # ATen program (before `to_edge`, as `ops_to_not_decompose` sees it)
    # keeps its own, which takes its in-place ops (a KV cache's `copy_`)
    verifiers = ep._verifiers
    if changed:
        ep._verifiers = [Verifier]
    try:
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        return buf.getvalue()
    finally:
        ep._verifiers = verifiers
        for node, target, args, kwargs in changed:
            node.target, node.args, node.kwargs = target, args, kwargs


def _spec_value(specs: List[CompileSpec], key: str) -> List[str]:
    return [s.value.decode("utf-8") for s in specs if s.key == key]


class EtMetalBackend(BackendDetails):
    """ExecuTorch backend `EtMetalBackend`: a partition → etmetal's delegate
    payload (kernels, dispatch plan, weight keys), the weights in GPU form
    through the named data store."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: List[CompileSpec]) -> PreprocessResult:
        payload, named = _etmetal.preprocess(_pt2_bytes(edge_program), *_int4_options(compile_specs))
        store = NamedDataStore()
        for key, data in named:
            store.add_named_data(key, data, WEIGHT_ALIGNMENT)
        return PreprocessResult(
            processed_bytes=payload,
            debug_handle_map={},
            data_store_output=store.get_named_data_store_output(),
        )

    @classmethod
    def generate_method_name_compile_spec(cls, method_name: str) -> CompileSpec:
        key, value = _etmetal.method_name_spec(method_name)
        return CompileSpec(key, value)

    @classmethod
    def method_name_from_compile_specs(cls, compile_specs: List[CompileSpec]) -> str:
        """The method name; RuntimeError ("Could not find method name …") without one."""
        return _etmetal.method_name([(s.key, bytes(s.value)) for s in compile_specs])

    @classmethod
    def generate_partition_compile_spec(cls, mode: str) -> CompileSpec:
        """`auto` (the default) delegates what it can; `whole` requires one partition."""
        return CompileSpec(PARTITION_KEY, mode.encode("utf-8"))

    @classmethod
    def generate_quantize_compile_spec(cls, scheme: str = "int4", group_size: int = 32) -> CompileSpec:
        """Quantize the delegated linears' weights (`int4`: group-wise
        affine, groups of 32/64/128/256), as `etmetal compile --quantize`."""
        if scheme != "int4":
            raise ValueError(f"quantize scheme {scheme!r}: only 'int4' is supported")
        return CompileSpec(QUANTIZE_KEY, f"{scheme}:{group_size}".encode("utf-8"))

    @classmethod
    def generate_quantize_skip_compile_spec(cls, pattern: str) -> CompileSpec:
        """Keep linears whose weight name contains `pattern` in float (`lm_head`); repeatable."""
        return CompileSpec(QUANTIZE_SKIP_KEY, pattern.encode("utf-8"))

    @classmethod
    def generate_skip_op_compile_spec(cls, op: str) -> CompileSpec:
        """Keep an op (etmetal's name: `sdpa`, `add`, …) off the GPU; repeatable."""
        return CompileSpec(SKIP_OP_KEY, op.encode("utf-8"))


def _int4_options(specs: List[CompileSpec]) -> Tuple[Optional[int], List[str]]:
    """(group size, skip patterns) from the quantize compile specs; (None, []) without one."""
    values = _spec_value(specs, QUANTIZE_KEY)
    if not values:
        return None, []
    scheme, _, group = values[-1].partition(":")
    if scheme != "int4" or not group.isdigit():
        raise ValueError(f"compile spec {QUANTIZE_KEY}={values[-1]!r}: expected 'int4:GROUP_SIZE'")
    return int(group), _spec_value(specs, QUANTIZE_SKIP_KEY)


class EtMetalPartitioner(Partitioner):
    """Tags the nodes etmetal's Rust partitioner delegates (same support
    table, convex partitions, modes and skip list as `etmetal compile`), and
    the constants only they read."""

    def __init__(self, compile_specs: Optional[List[CompileSpec]] = None) -> None:
        super().__init__()
        self.compile_specs = list(compile_specs or [])
        modes = _spec_value(self.compile_specs, PARTITION_KEY)
        self.mode = modes[-1] if modes else "auto"
        if self.mode not in ("auto", "whole"):
            raise ValueError(f"compile spec {PARTITION_KEY}={self.mode!r}: expected 'auto' or 'whole'")
        self.skip_ops = _spec_value(self.compile_specs, SKIP_OP_KEY)
        self.delegation_spec = DelegationSpec(EtMetalBackend.__name__, self.compile_specs)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        rows = _etmetal.partition(_pt2_bytes(exported_program), self.mode, self.skip_ops)
        # a source node is delegated when every node it imports to is in one partition
        placed: Dict[str, set] = {}
        for fx, pid, _op, _reason in rows:
            placed.setdefault(fx, set()).add(pid)
        nodes = [n for n in exported_program.graph.nodes if n.op == "call_function"]
        tag_of: Dict[torch.fx.Node, Optional[str]] = {}
        unplaced = []
        for node in nodes:
            ids = placed.get(node.name)
            if ids is None:
                unplaced.append(node)
            elif len(ids) == 1 and None not in ids:
                tag_of[node] = f"tag{next(iter(ids))}"
        _place_folded(unplaced, tag_of)
        partition_tags = {}
        for node, tag in tag_of.items():
            if tag is not None:
                node.meta["delegation_tag"] = tag
                partition_tags[tag] = self.delegation_spec
        tag_constant_data(exported_program)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=partition_tags)

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> Tuple[List[torch._ops.OpOverload], Optional[Callable[[torch.fx.Node], bool]]]:
        """The ops of the nodes the backend takes whole (linear, SDPA, norms,
        …; not skipped, within its dtype and size limits), so they reach its
        fused kernels; a filter only when some nodes of an op are taken and
        others not."""
        if any(n.target is executorch_call_delegate for n in ep.graph.nodes):
            # ExecuTorch asks again after lowering, to check what stayed
            # outside the delegates: that is what the partitioner refused, so
            # nothing of it is kept whole
            return [], None
        rows = _etmetal.ops_taken(_pt2_bytes(ep), self.skip_ops)
        taken = {name for name, keep in rows if keep}
        calls = [n for n in ep.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
        ops = list(dict.fromkeys(n.target for n in calls if n.name in taken))
        mixed = any(n.target in ops and n.name not in taken for n in calls)
        return ops, (lambda n: n.name in taken) if mixed else None


def _place_folded(unplaced: List[torch.fx.Node], tag_of: Dict[torch.fx.Node, Optional[str]]) -> None:
    """Tags for source nodes that import to no node of their own: `getitem`
    (part of its producer), identities the importer folds, dead nodes. Such
    a node joins its producer's partition, else its readers' when they agree,
    so partitions stay convex."""

    def producer_tag(node):
        ins = [a for a in node.all_input_nodes if a.op == "call_function"]
        tags = {tag_of.get(a) for a in ins}
        return tags.pop() if len(tags) == 1 and len(ins) == len(node.all_input_nodes) else None

    for node in unplaced:  # graph order: producers first
        tag = producer_tag(node)
        if node.target is operator.getitem or tag is not None:
            tag_of[node] = tag
    for node in reversed(unplaced):
        if tag_of.get(node) is None:
            tags = {tag_of.get(u) for u in node.users}
            tag_of[node] = tags.pop() if len(tags) == 1 else None
