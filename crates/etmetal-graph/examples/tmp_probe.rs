fn main() {
    for f in std::env::args().skip(1) {
        let g = etmetal_graph::load_pt2(std::path::Path::new(&f)).unwrap();
        println!("== {f}");
        for n in &g.nodes {
            let ins: Vec<String> = n
                .inputs
                .iter()
                .map(|i| {
                    i.map_or("-".into(), |v| {
                        let vi = g.value(v);
                        format!(
                            "{}{}:{}{:?}",
                            vi.name,
                            if g.constants.contains_key(&v) {
                                "(c)"
                            } else {
                                ""
                            },
                            vi.dtype,
                            vi.shape
                        )
                    })
                })
                .collect();
            println!(
                "  {} {:?} {} <- {}",
                n.name,
                n.op,
                n.target.trim_start_matches("torch.ops.aten."),
                ins.join(", ")
            );
        }
    }
}
