//! What a user can do about a target etmetal does not lower, where a
//! documented rewrite helps: the "no lowering" error carries it.

use etmetal_core::op_table;

/// ATen ops whose `run_decompositions()` forms are ops etmetal lowers
/// (checked by tests/parity/test_lowerings.py).
const DECOMPOSED_BY_TORCH: &[&str] = &["logit", "cosine_similarity"];

/// Ops exported only from a model left in training mode.
const TRAINING_ONLY: &[&str] = &[
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "native_batch_norm",
    "rrelu_with_noise",
];

/// The rewrite that gets `target` past the importer, if one is known.
pub(super) fn hint(target: &str) -> Option<String> {
    if target.starts_with("torch.ops.higher_order.") {
        return Some(
            "control flow is not imported: export with the branch taken in Python \
             (no `torch.cond`/`while_loop`), which torch.export traces away"
                .into(),
        );
    }
    let Some(short) = target.strip_prefix("torch.ops.aten.") else {
        let name = target.rsplit_once('.').map_or(target, |(n, _)| n);
        return Some(format!(
            "a custom op: etmetal lowers `torch.ops.aten` targets only; save the program \
             after `ep.run_decompositions({{{name}: f}})` with `f` a decomposition of it \
             into ATen ops"
        ));
    };
    let name = short.split_once('.').map_or(short, |(n, _)| n);
    // an in-place op gets the hint of its functional form
    let name = op_table::functional_aten(name).unwrap_or(name);
    if DECOMPOSED_BY_TORCH.contains(&name) {
        return Some(
            "save the program after `ep.run_decompositions()`, which rewrites it into \
             ops etmetal lowers"
                .into(),
        );
    }
    if TRAINING_ONLY.contains(&name) {
        return Some("the model was exported in training mode: export after `model.eval()`".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::hint;

    #[test]
    fn hints_name_the_rewrite() {
        let h = |t: &str| hint(t).unwrap_or_default();
        assert!(h("torch.ops.aten.logit.default").contains("run_decompositions()"));
        assert!(h("torch.ops.aten._native_batch_norm_legit.default").contains("model.eval()"));
        assert!(h("torch.ops.mylib.norm.default").contains("torch.ops.mylib.norm"));
        assert!(h("torch.ops.higher_order.cond").contains("torch.cond"));
        assert_eq!(hint("torch.ops.aten.lstm.input"), None);
    }
}
