//! The named data of a program (the delegates' weights), gathered from
//! every method and partition before the file is written, as ExecuTorch's
//! `exir/_serialize/_named_data_store.py` gathers it: an entry is a key and
//! its bytes, the same key with the same bytes is stored once.
//!
//! Where ExecuTorch refuses the same key with other bytes, the store has
//! one rule for it ([`NamedDataStore::key_for`]): the later owner (a method)
//! stores them under `key@owner`. A decoder's prefill and decode lift
//! constants of their own lengths (`positions`) under one name.

use std::collections::HashMap;

use etmetal_core::{Error, Result};

use crate::{add_named_data, Program, Segment};

/// Keys and bytes in the order they were first stored.
#[derive(Clone, Debug, Default)]
pub struct NamedDataStore {
    entries: Vec<(String, Vec<u8>)>,
    /// Key → index into `entries`.
    index: HashMap<String, usize>,
}

impl NamedDataStore {
    pub fn new() -> NamedDataStore {
        NamedDataStore::default()
    }

    /// The key under which `owner` stores `bytes` it names `key`: `key`
    /// itself when it is free or holds these bytes already, else
    /// `key@owner`.
    pub fn key_for(&self, key: &str, bytes: &[u8], owner: &str) -> String {
        match self.get(key) {
            Some(stored) if stored != bytes => format!("{key}@{owner}"),
            _ => key.to_string(),
        }
    }

    /// Store `bytes` under `key` (as [`NamedDataStore::key_for`] chose it):
    /// the same bytes again are kept once; other bytes under a stored key
    /// are an error.
    pub fn insert(&mut self, key: String, bytes: Vec<u8>) -> Result<()> {
        match self.index.get(&key) {
            Some(&i) if self.entries[i].1 == bytes => Ok(()),
            Some(_) => Err(Error::invalid_input(format!(
                "named data `{key}` is stored with other bytes already"
            ))),
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, bytes));
                Ok(())
            }
        }
    }

    /// The bytes stored under `key`.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.index.get(key).map(|&i| self.entries[i].1.as_slice())
    }

    /// `(key, bytes)` in the order they were first stored.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries.iter().map(|(k, b)| (k.as_str(), b.as_slice()))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Add every entry to `program`'s named data, in order, each in a
    /// segment of `alignment` appended to `segments` (equal bytes under two
    /// keys share one segment, as [`add_named_data`] does).
    pub fn write_into<'a>(
        &'a self,
        program: &mut Program,
        segments: &mut Vec<Segment<'a>>,
        alignment: u64,
    ) -> Result<()> {
        for (key, bytes) in self.iter() {
            add_named_data(program, segments, key, bytes, alignment)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_and_bytes_are_stored_once_other_bytes_under_the_owners_key() {
        let mut store = NamedDataStore::new();
        let key = store.key_for("w", &[1, 2], "forward");
        assert_eq!(key, "w");
        store.insert(key, vec![1, 2]).unwrap();
        // another method with the same weight shares it
        let key = store.key_for("w", &[1, 2], "prefill");
        assert_eq!(key, "w");
        store.insert(key, vec![1, 2]).unwrap();
        // other bytes under the same name step aside
        let key = store.key_for("w", &[3], "prefill");
        assert_eq!(key, "w@prefill");
        store.insert(key, vec![3]).unwrap();
        let keys: Vec<&str> = store.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["w", "w@prefill"]);
        assert_eq!(store.get("w@prefill"), Some(&[3u8][..]));
        let e = store.insert("w".into(), vec![9]).unwrap_err().to_string();
        assert!(e.contains("`w` is stored with other bytes"), "{e}");
    }

    #[test]
    fn written_entries_keep_their_order_and_share_equal_bytes() {
        let mut store = NamedDataStore::new();
        for (key, bytes) in [("a", vec![1u8; 4]), ("b", vec![2; 4]), ("c", vec![1; 4])] {
            store.insert(key.into(), bytes).unwrap();
        }
        let mut program = Program::default();
        let mut segments = vec![Segment::new(vec![0u8])];
        store.write_into(&mut program, &mut segments, 16).unwrap();
        let named: Vec<(&str, u32)> = program
            .named_data
            .iter()
            .map(|n| (n.key.as_str(), n.segment_index))
            .collect();
        assert_eq!(named, [("a", 1), ("b", 2), ("c", 1)]);
        assert_eq!(segments.len(), 3);
        assert_eq!(segments[1].alignment, 16);
    }
}
