//! Symbolic sizes (bounded dynamic shapes): integer expressions over the
//! symbols of a `torch.export` program (`Dim("seq", min=1, max=2048)`,
//! written `s77` in the archive), with each symbol's range.
//!
//! An expression is built (`+`, `-`, `*` and the constructors) in a canonical form (sums of terms with integer
//! coefficients, constants folded), so `3*s - 2*s` is `s` and two ways of
//! writing one size compare equal. It evaluates under bindings (the actual
//! sizes of a run) and has bounds over the ranges (memory is planned at the
//! upper bound). The parser reads sympy's `srepr`, the form the archive's
//! `as_expr` sizes are written in.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::{Add, Mul, Sub};

use crate::error::{Error, Result};

/// The inclusive range of one symbol (`range_constraints` of the export).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SymRange {
    pub min: i64,
    pub max: i64,
}

/// The range of every symbol of a program, by name.
pub type SymRanges = BTreeMap<String, SymRange>;

/// An integer expression over symbols. Build it with `+`, `-`, `*` and
/// the constructors ([`SymExpr::floor_div`], …), which keep it canonical.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SymExpr {
    Const(i64),
    Sym(String),
    /// A sum of at least two terms, the constant (if any) last.
    Add(Vec<SymExpr>),
    /// A product of at least two factors, the constant coefficient (if any) first.
    Mul(Vec<SymExpr>),
    /// Python's `//` (rounds toward negative infinity).
    FloorDiv(Box<SymExpr>, Box<SymExpr>),
    /// Python's `%` (the sign of the divisor).
    Mod(Box<SymExpr>, Box<SymExpr>),
    Max(Box<SymExpr>, Box<SymExpr>),
    Min(Box<SymExpr>, Box<SymExpr>),
}

fn floor_div(a: i64, b: i64) -> Result<i64> {
    if b == 0 {
        return Err(Error::invalid_input("symbolic size: division by zero"));
    }
    let q = a / b;
    Ok(if (a % b != 0) && ((a < 0) != (b < 0)) {
        q - 1
    } else {
        q
    })
}

fn py_mod(a: i64, b: i64) -> Result<i64> {
    Ok(a - floor_div(a, b)? * b)
}

fn overflow() -> Error {
    Error::limit("symbolic size overflows i64")
}

impl SymExpr {
    pub fn sym(name: impl Into<String>) -> SymExpr {
        SymExpr::Sym(name.into())
    }

    /// The value when the expression has no symbol.
    pub fn as_const(&self) -> Option<i64> {
        match self {
            SymExpr::Const(c) => Some(*c),
            _ => None,
        }
    }

    /// `coef * rest` of a term (`rest` `None` for a constant).
    fn split_coef(&self) -> (i64, Option<SymExpr>) {
        match self {
            SymExpr::Const(c) => (*c, None),
            SymExpr::Mul(fs) => match fs[0] {
                SymExpr::Const(c) => {
                    let rest = if fs.len() == 2 {
                        fs[1].clone()
                    } else {
                        SymExpr::Mul(fs[1..].to_vec())
                    };
                    (c, Some(rest))
                }
                _ => (1, Some(self.clone())),
            },
            e => (1, Some(e.clone())),
        }
    }

    /// `a // b`; terms of `a` that are multiples of a constant `b` come
    /// out of the division (`(s + 2) // 2` is `s // 2 + 1`).
    pub fn floor_div(a: SymExpr, b: SymExpr) -> Result<SymExpr> {
        Ok(match (a.as_const(), b.as_const()) {
            (Some(x), Some(y)) => SymExpr::Const(floor_div(x, y)?),
            (_, Some(0)) => return Err(Error::invalid_input("symbolic size: division by zero")),
            (_, Some(1)) => a,
            (_, Some(d)) if d > 0 => {
                let terms = match a {
                    SymExpr::Add(ts) => ts,
                    t => vec![t],
                };
                let (mut out, mut rest) = (SymExpr::Const(0), SymExpr::Const(0));
                for t in terms {
                    match t.split_coef() {
                        (k, r) if k % d == 0 => {
                            let q = SymExpr::Const(k / d);
                            out = out + r.map_or(q.clone(), |r| q * r);
                        }
                        _ => rest = rest + t,
                    }
                }
                if rest != SymExpr::Const(0) {
                    out = out + SymExpr::FloorDiv(Box::new(rest), Box::new(b));
                }
                out
            }
            _ => SymExpr::FloorDiv(Box::new(a), Box::new(b)),
        })
    }

    pub fn modulo(a: SymExpr, b: SymExpr) -> Result<SymExpr> {
        Ok(match (a.as_const(), b.as_const()) {
            (Some(x), Some(y)) => SymExpr::Const(py_mod(x, y)?),
            (_, Some(0)) => return Err(Error::invalid_input("symbolic size: modulo by zero")),
            (_, Some(1)) => SymExpr::Const(0),
            _ => SymExpr::Mod(Box::new(a), Box::new(b)),
        })
    }

    pub fn max(a: SymExpr, b: SymExpr) -> SymExpr {
        match (a.as_const(), b.as_const()) {
            (Some(x), Some(y)) => SymExpr::Const(x.max(y)),
            _ if a == b => a,
            _ => SymExpr::Max(Box::new(a.clone().min_of(&b)), Box::new(a.max_of(b))),
        }
    }

    pub fn min(a: SymExpr, b: SymExpr) -> SymExpr {
        match (a.as_const(), b.as_const()) {
            (Some(x), Some(y)) => SymExpr::Const(x.min(y)),
            _ if a == b => a,
            _ => SymExpr::Min(Box::new(a.clone().min_of(&b)), Box::new(a.max_of(b))),
        }
    }

    // the operands of Max/Min in a fixed order, so `max(a, b) == max(b, a)`
    fn min_of(self, other: &SymExpr) -> SymExpr {
        if self <= *other {
            self
        } else {
            other.clone()
        }
    }
    fn max_of(self, other: SymExpr) -> SymExpr {
        if self <= other {
            other
        } else {
            self
        }
    }

    /// `(k, c)` when the expression is `k*name + c` (`k != 0`): how a
    /// symbol is read back from a size derived from it (`2*s` → `s`).
    pub fn affine_in(&self, name: &str) -> Option<(i64, i64)> {
        let term = |t: &SymExpr| match t.split_coef() {
            (c, None) => Some((0, c)),
            (k, Some(SymExpr::Sym(s))) if s == name => Some((k, 0)),
            _ => None,
        };
        let (k, c) = match self {
            SymExpr::Add(ts) => ts.iter().try_fold((0, 0), |(k, c), t| {
                let (k2, c2) = term(t)?;
                Some((k + k2, c + c2))
            })?,
            e => term(e)?,
        };
        (k != 0).then_some((k, c))
    }

    /// The symbols the expression reads, each once, sorted.
    pub fn symbols(&self) -> Vec<&str> {
        fn walk<'a>(e: &'a SymExpr, out: &mut Vec<&'a str>) {
            match e {
                SymExpr::Const(_) => {}
                SymExpr::Sym(s) => out.push(s),
                SymExpr::Add(xs) | SymExpr::Mul(xs) => xs.iter().for_each(|x| walk(x, out)),
                SymExpr::FloorDiv(a, b)
                | SymExpr::Mod(a, b)
                | SymExpr::Max(a, b)
                | SymExpr::Min(a, b) => {
                    walk(a, out);
                    walk(b, out);
                }
            }
        }
        let mut out = vec![];
        walk(self, &mut out);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The value under `bindings` (symbol → actual size).
    pub fn eval(&self, bindings: &HashMap<String, i64>) -> Result<i64> {
        let bin = |a: &SymExpr, b: &SymExpr| Ok::<_, Error>((a.eval(bindings)?, b.eval(bindings)?));
        match self {
            SymExpr::Const(c) => Ok(*c),
            SymExpr::Sym(s) => bindings
                .get(s)
                .copied()
                .ok_or_else(|| Error::invalid_input(format!("symbol `{s}` has no value"))),
            SymExpr::Add(xs) => xs.iter().try_fold(0i64, |acc, x| {
                acc.checked_add(x.eval(bindings)?).ok_or_else(overflow)
            }),
            SymExpr::Mul(xs) => xs.iter().try_fold(1i64, |acc, x| {
                acc.checked_mul(x.eval(bindings)?).ok_or_else(overflow)
            }),
            SymExpr::FloorDiv(a, b) => bin(a, b).and_then(|(a, b)| floor_div(a, b)),
            SymExpr::Mod(a, b) => bin(a, b).and_then(|(a, b)| py_mod(a, b)),
            SymExpr::Max(a, b) => bin(a, b).map(|(a, b)| a.max(b)),
            SymExpr::Min(a, b) => bin(a, b).map(|(a, b)| a.min(b)),
        }
    }

    /// `(lowest, highest)` value over `ranges` (interval arithmetic: a
    /// bound, exact for the sums and products of sizes shapes are made of).
    /// A symbol without a range is an error naming it.
    pub fn bounds(&self, ranges: &SymRanges) -> Result<(i64, i64)> {
        let corners = |a: (i64, i64), b: (i64, i64), f: &dyn Fn(i64, i64) -> Result<i64>| {
            let v = [f(a.0, b.0)?, f(a.0, b.1)?, f(a.1, b.0)?, f(a.1, b.1)?];
            Ok::<_, Error>((
                v.iter().copied().min().unwrap_or(0),
                v.iter().copied().max().unwrap_or(0),
            ))
        };
        match self {
            SymExpr::Const(c) => Ok((*c, *c)),
            SymExpr::Sym(s) => ranges.get(s).map(|r| (r.min, r.max)).ok_or_else(|| {
                Error::unsupported(format!(
                    "symbol `{s}` has no upper bound: export with torch.export.Dim(…, max=N)"
                ))
            }),
            SymExpr::Add(xs) => xs.iter().try_fold((0i64, 0i64), |(lo, hi), x| {
                let (a, b) = x.bounds(ranges)?;
                Ok((
                    lo.checked_add(a).ok_or_else(overflow)?,
                    hi.checked_add(b).ok_or_else(overflow)?,
                ))
            }),
            SymExpr::Mul(xs) => xs.iter().try_fold((1i64, 1i64), |acc, x| {
                corners(acc, x.bounds(ranges)?, &|a, b| {
                    a.checked_mul(b).ok_or_else(overflow)
                })
            }),
            SymExpr::FloorDiv(a, b) => {
                let (a, b) = (a.bounds(ranges)?, b.bounds(ranges)?);
                if b.0 <= 0 && b.1 >= 0 {
                    return Err(Error::unsupported(format!(
                        "symbolic size `{self}`: the divisor may be zero"
                    )));
                }
                corners(a, b, &floor_div)
            }
            SymExpr::Mod(a, b) => {
                let (a, b) = (a.bounds(ranges)?, b.bounds(ranges)?);
                if b.0 <= 0 {
                    return Err(Error::unsupported(format!(
                        "symbolic size `{self}`: the divisor may not be positive"
                    )));
                }
                // a non-negative dividend below the divisor is unchanged
                Ok(if a.0 >= 0 && a.1 < b.0 {
                    a
                } else {
                    (0, b.1 - 1)
                })
            }
            SymExpr::Max(a, b) => {
                let (a, b) = (a.bounds(ranges)?, b.bounds(ranges)?);
                Ok((a.0.max(b.0), a.1.max(b.1)))
            }
            SymExpr::Min(a, b) => {
                let (a, b) = (a.bounds(ranges)?, b.bounds(ranges)?);
                Ok((a.0.min(b.0), a.1.min(b.1)))
            }
        }
    }

    /// The largest value over `ranges`, as a size (a negative bound is an error).
    pub fn upper_bound(&self, ranges: &SymRanges) -> Result<usize> {
        let (_, hi) = self.bounds(ranges)?;
        usize::try_from(hi)
            .map_err(|_| Error::shape(format!("symbolic size `{self}` has upper bound {hi}")))
    }

    /// Parse sympy's `srepr` of an integer expression, as torch.export
    /// writes sizes (`Add(Mul(Integer(2), Symbol('s77', positive=True,
    /// integer=True)), Integer(-1))`). Functions: `Integer`, `Symbol`,
    /// `Add`, `Mul`, `FloorDiv`, `Mod`/`PythonMod`, `Max`, `Min`; anything
    /// else is an `Unsupported` error naming it.
    pub fn parse_srepr(s: &str) -> Result<SymExpr> {
        let mut p = Parser {
            s: s.as_bytes(),
            i: 0,
        };
        let e = p
            .expr()
            .map_err(|e| e.context(format!("symbolic size `{s}`")))?;
        p.skip_ws();
        if p.i != p.s.len() {
            return Err(Error::format(format!(
                "symbolic size `{s}`: trailing text at byte {}",
                p.i
            )));
        }
        Ok(e)
    }
}

impl Add for SymExpr {
    type Output = SymExpr;

    /// `a + b`, with like terms merged (`3*s + -2*s` is `s`).
    fn add(self, b: SymExpr) -> SymExpr {
        let a = self;
        let mut terms: Vec<(SymExpr, i64)> = vec![];
        let mut constant = 0i64;
        for t in [a, b] {
            let parts = match t {
                SymExpr::Add(ts) => ts,
                t => vec![t],
            };
            for p in parts {
                match p.split_coef() {
                    (c, None) => constant = constant.wrapping_add(c),
                    (c, Some(rest)) => match terms.iter_mut().find(|(r, _)| *r == rest) {
                        Some((_, k)) => *k = k.wrapping_add(c),
                        None => terms.push((rest, c)),
                    },
                }
            }
        }
        let mut out: Vec<SymExpr> = terms
            .into_iter()
            .filter(|(_, k)| *k != 0)
            .map(|(r, k)| SymExpr::mul(SymExpr::Const(k), r))
            .collect();
        out.sort();
        if constant != 0 || out.is_empty() {
            out.push(SymExpr::Const(constant));
        }
        if out.len() == 1 {
            out.pop().unwrap_or(SymExpr::Const(0))
        } else {
            SymExpr::Add(out)
        }
    }
}

impl Sub for SymExpr {
    type Output = SymExpr;

    fn sub(self, b: SymExpr) -> SymExpr {
        let a = self;
        SymExpr::add(a, SymExpr::mul(SymExpr::Const(-1), b))
    }
}

impl Mul for SymExpr {
    type Output = SymExpr;

    /// `a * b`; a constant times a sum distributes (`2*(s + 1)` is `2*s + 2`).
    fn mul(self, b: SymExpr) -> SymExpr {
        let a = self;
        let mut coef = 1i64;
        let mut factors = vec![];
        for f in [a, b] {
            let parts = match f {
                SymExpr::Mul(fs) => fs,
                f => vec![f],
            };
            for p in parts {
                match p {
                    SymExpr::Const(c) => coef = coef.wrapping_mul(c),
                    p => factors.push(p),
                }
            }
        }
        if coef == 0 {
            return SymExpr::Const(0);
        }
        match factors.len() {
            0 => SymExpr::Const(coef),
            1 => match factors.pop() {
                Some(SymExpr::Add(ts)) if coef != 1 => ts
                    .into_iter()
                    .map(|t| SymExpr::mul(SymExpr::Const(coef), t))
                    .fold(SymExpr::Const(0), SymExpr::add),
                Some(f) if coef == 1 => f,
                Some(f) => SymExpr::Mul(vec![SymExpr::Const(coef), f]),
                None => SymExpr::Const(coef),
            },
            _ => {
                factors.sort();
                if coef != 1 {
                    factors.insert(0, SymExpr::Const(coef));
                }
                SymExpr::Mul(factors)
            }
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.skip_ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn token(&mut self, ok: impl Fn(u8) -> bool) -> &str {
        self.skip_ws();
        let start = self.i;
        while self.s.get(self.i).is_some_and(|&c| ok(c)) {
            self.i += 1;
        }
        std::str::from_utf8(&self.s[start..self.i]).unwrap_or("")
    }

    fn expect(&mut self, c: u8) -> Result<()> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(Error::format(format!(
                "expected `{}` at byte {}",
                c as char, self.i
            )))
        }
    }

    /// `'name'`, then any `key=value` keyword arguments (ignored).
    fn symbol_args(&mut self) -> Result<String> {
        self.expect(b'\'')?;
        let name = self.token(|c| c != b'\'').to_string();
        self.expect(b'\'')?;
        while self.eat(b',') {
            self.token(|c| c != b',' && c != b')');
        }
        self.expect(b')')?;
        Ok(name)
    }

    fn expr(&mut self) -> Result<SymExpr> {
        let func = self
            .token(|c| c.is_ascii_alphanumeric() || c == b'_')
            .to_string();
        self.expect(b'(')?;
        match func.as_str() {
            "Symbol" => return Ok(SymExpr::Sym(self.symbol_args()?)),
            "Integer" => {
                let n = self.token(|c| c.is_ascii_digit() || c == b'-');
                let n = n
                    .parse::<i64>()
                    .map_err(|_| Error::format(format!("bad integer `{n}`")))?;
                self.expect(b')')?;
                return Ok(SymExpr::Const(n));
            }
            _ => {}
        }
        let mut args = vec![self.expr()?];
        while self.eat(b',') {
            args.push(self.expr()?);
        }
        self.expect(b')')?;
        let two = |args: Vec<SymExpr>| -> Result<(SymExpr, SymExpr)> {
            let mut it = args.into_iter();
            match (it.next(), it.next(), it.next()) {
                (Some(a), Some(b), None) => Ok((a, b)),
                _ => Err(Error::format(format!("`{func}` takes two arguments"))),
            }
        };
        let fold = |args: Vec<SymExpr>, f: fn(SymExpr, SymExpr) -> SymExpr| {
            let mut it = args.into_iter();
            let first = it.next().unwrap_or(SymExpr::Const(0));
            it.fold(first, f)
        };
        match func.as_str() {
            "Add" => Ok(fold(args, SymExpr::add)),
            "Mul" => Ok(fold(args, SymExpr::mul)),
            "Max" => Ok(fold(args, SymExpr::max)),
            "Min" => Ok(fold(args, SymExpr::min)),
            "FloorDiv" => two(args).and_then(|(a, b)| SymExpr::floor_div(a, b)),
            "Mod" | "PythonMod" => two(args).and_then(|(a, b)| SymExpr::modulo(a, b)),
            other => Err(Error::unsupported(format!(
                "sympy function `{other}` in a symbolic size"
            ))),
        }
    }
}

impl fmt::Display for SymExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |f: &mut fmt::Formatter<'_>, xs: &[SymExpr], sep: &str| {
            for (i, x) in xs.iter().enumerate() {
                if i > 0 {
                    f.write_str(sep)?;
                }
                match x {
                    SymExpr::Add(_) => write!(f, "({x})")?,
                    x => write!(f, "{x}")?,
                }
            }
            Ok(())
        };
        match self {
            SymExpr::Const(c) => write!(f, "{c}"),
            SymExpr::Sym(s) => f.write_str(s),
            SymExpr::Add(xs) => list(f, xs, " + "),
            SymExpr::Mul(xs) => list(f, xs, "*"),
            SymExpr::FloorDiv(a, b) => write!(f, "({a}) // ({b})"),
            SymExpr::Mod(a, b) => write!(f, "({a}) % ({b})"),
            SymExpr::Max(a, b) => write!(f, "max({a}, {b})"),
            SymExpr::Min(a, b) => write!(f, "min({a}, {b})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: &str) -> SymExpr {
        SymExpr::sym(n)
    }
    fn c(v: i64) -> SymExpr {
        SymExpr::Const(v)
    }

    #[test]
    fn canonical_form_merges_like_terms_and_folds_constants() {
        let three_s = SymExpr::mul(c(3), s("s"));
        let two_s = SymExpr::mul(s("s"), c(2));
        assert_eq!(SymExpr::sub(three_s, two_s), s("s"));
        let a = SymExpr::add(SymExpr::add(s("a"), c(1)), SymExpr::add(s("b"), c(-1)));
        assert_eq!(a, SymExpr::add(s("b"), s("a")));
        assert_eq!(SymExpr::sub(s("a"), s("a")), c(0));
        // a constant distributes over a sum
        let d = SymExpr::mul(c(2), SymExpr::add(s("a"), c(1)));
        assert_eq!(d.to_string(), "2*a + 2");
        assert_eq!(SymExpr::max(s("a"), s("b")), SymExpr::max(s("b"), s("a")));
        assert_eq!(SymExpr::floor_div(c(-7), c(2)).unwrap(), c(-4));
        // multiples of the divisor come out: (4a + 2b - 2) // 2 = 2a + b - 1
        let e = SymExpr::add(SymExpr::mul(c(4), s("a")), SymExpr::mul(c(2), s("b")));
        let e = SymExpr::floor_div(SymExpr::add(e, c(-2)), c(2)).unwrap();
        assert_eq!(e.to_string(), "b + 2*a + -1");
        let h = SymExpr::floor_div(SymExpr::add(s("h"), c(3)), c(2)).unwrap();
        assert_eq!(
            h,
            SymExpr::floor_div(SymExpr::add(s("h"), c(3)), c(2)).unwrap()
        );
        assert_eq!(h.eval(&HashMap::from([("h".to_string(), 4)])).unwrap(), 3);
        assert_eq!(SymExpr::modulo(c(-7), c(3)).unwrap(), c(2));
    }

    #[test]
    fn parses_what_torch_export_writes_and_evaluates() {
        let sym = "Symbol('s77', positive=True, integer=True)";
        let e = SymExpr::parse_srepr(&format!(
            "Add(FloorDiv({sym}, Integer(2)), Mul(Integer(3), {sym}), Integer(-1))"
        ))
        .unwrap();
        assert_eq!(e.symbols(), ["s77"]);
        let at = |v: i64| e.eval(&HashMap::from([("s77".to_string(), v)])).unwrap();
        assert_eq!(at(5), 5 / 2 + 15 - 1);
        assert_eq!(at(1), 2);
        assert_eq!(e.affine_in("s77"), None);
        let lin = SymExpr::add(SymExpr::mul(c(2), s("s77")), c(-1));
        assert_eq!(lin.affine_in("s77"), Some((2, -1)));
        assert_eq!(s("s77").affine_in("s77"), Some((1, 0)));
        assert_eq!(lin.affine_in("t"), None);
        let m = SymExpr::parse_srepr(&format!("Max(Integer(5), {sym})")).unwrap();
        assert_eq!(m, SymExpr::max(s("s77"), c(5)));
        let err = SymExpr::parse_srepr(&format!("CeilToInt({sym})")).unwrap_err();
        assert!(err.to_string().contains("`CeilToInt`"), "{err}");
        assert!(SymExpr::parse_srepr("Integer(3) junk").is_err());
        assert!(SymExpr::parse_srepr("Add(Integer(3)").is_err());
        let unbound = s("q").eval(&HashMap::new()).unwrap_err().to_string();
        assert!(unbound.contains("symbol `q` has no value"), "{unbound}");
    }

    #[test]
    fn bounds_over_ranges() {
        let ranges = SymRanges::from([
            ("a".to_string(), SymRange { min: 2, max: 16 }),
            ("b".to_string(), SymRange { min: 1, max: 8 }),
        ]);
        let b = |e: SymExpr| e.bounds(&ranges).unwrap();
        assert_eq!(b(SymExpr::mul(s("a"), s("b"))), (2, 128));
        // not monotone: the upper bound is at the lower end of the range
        assert_eq!(b(SymExpr::sub(c(20), s("a"))), (4, 18));
        assert_eq!(b(SymExpr::floor_div(s("a"), c(3)).unwrap()), (0, 5));
        assert_eq!(b(SymExpr::modulo(s("a"), c(4)).unwrap()), (0, 3));
        assert_eq!(b(SymExpr::modulo(s("b"), c(9)).unwrap()), (1, 8));
        assert_eq!(b(SymExpr::min(s("a"), c(10))), (2, 10));
        assert_eq!(b(SymExpr::max(s("b"), c(5))), (5, 8));
        assert_eq!(SymExpr::add(s("a"), c(1)).upper_bound(&ranges).unwrap(), 17);
        let err = s("z").bounds(&ranges).unwrap_err().to_string();
        assert!(err.contains("symbol `z` has no upper bound"), "{err}");
        assert!(SymExpr::sub(c(1), s("a")).upper_bound(&ranges).is_err());
        assert!(SymExpr::floor_div(c(4), SymExpr::sub(s("b"), c(1)))
            .unwrap()
            .bounds(&ranges)
            .is_err());
    }
}
