//! Greedy CTC decoding (wav2vec2, HuBERT, Parakeet-CTC): the most likely
//! token of each frame, repeats collapsed, the blank dropped, the rest
//! turned into text with the model's vocabulary.
//!
//! Two vocabularies: wav2vec2's `vocab.json` of characters, read as
//! transformers' `Wav2Vec2CTCTokenizer` decodes (`pad_token` is the blank,
//! `word_delimiter_token` becomes a space, the text stripped, lower-cased
//! with `do_lower_case`, tokenization spaces cleaned where
//! `clean_up_tokenization_spaces`); or a `tokenizer.json` (sub-word CTC
//! heads), whose decode of the collapsed ids gives the text, special
//! tokens left out.

use std::collections::HashMap;
use std::path::Path;

use etmetal_core::{Error, Result};

use crate::generate::TextTokenizer;

/// A CTC model's vocabulary and its blank.
pub enum Vocabulary {
    /// `vocab.json` (id → token) with `tokenizer_config.json`'s rules.
    Chars {
        tokens: HashMap<u32, String>,
        blank: u32,
        delimiter: String,
        lower: bool,
        clean_up: bool,
    },
    /// A `tokenizer.json`; the blank is the config's pad id, or the last id.
    Tokenizer {
        tokenizer: Box<TextTokenizer>,
        blank: u32,
    },
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::invalid_input(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path.display(), e)),
    }
}

/// A token written as a string or as `{"content": ...}`.
fn token_text(v: &serde_json::Value) -> Option<&str> {
    v.as_str().or_else(|| v["content"].as_str())
}

impl Vocabulary {
    /// The vocabulary in `dir`: `vocab.json` (with `tokenizer_config.json`)
    /// or `tokenizer.json`; `vocab_size` is the logits' last dim.
    pub fn load(dir: &Path, vocab_size: usize) -> Result<Vocabulary> {
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let model_config = read_json(&dir.join("config.json"))?.unwrap_or_default();
        if let Some(vocab) = read_json(&dir.join("vocab.json"))? {
            let map = vocab.as_object().ok_or_else(|| {
                Error::invalid_input(format!(
                    "{}: not a token → id map",
                    dir.join("vocab.json").display()
                ))
            })?;
            let tokens: HashMap<u32, String> = map
                .iter()
                .filter_map(|(t, id)| Some((id.as_u64()? as u32, t.clone())))
                .collect();
            let pad = token_text(&config["pad_token"]).unwrap_or("<pad>");
            let blank = map
                .get(pad)
                .and_then(|v| v.as_u64())
                .map(|v| v as u32)
                .ok_or_else(|| {
                    Error::invalid_input(format!(
                        "{}: no blank: the pad token `{pad}` is not in vocab.json",
                        dir.display()
                    ))
                })?;
            return Ok(Vocabulary::Chars {
                tokens,
                blank,
                delimiter: token_text(&config["word_delimiter_token"])
                    .unwrap_or("|")
                    .to_string(),
                lower: config["do_lower_case"].as_bool().unwrap_or(false),
                clean_up: config["clean_up_tokenization_spaces"]
                    .as_bool()
                    .unwrap_or(false),
            });
        }
        let path = dir.join("tokenizer.json");
        if path.is_file() {
            let tokenizer = Box::new(TextTokenizer::load(&path)?);
            let blank = model_config["pad_token_id"]
                .as_u64()
                .map(|v| v as u32)
                .unwrap_or(vocab_size.saturating_sub(1) as u32);
            return Ok(Vocabulary::Tokenizer { tokenizer, blank });
        }
        Err(Error::invalid_input(format!(
            "{}: no vocabulary for the CTC model: neither vocab.json nor tokenizer.json \
             (save the processor beside the program: `processor.save_pretrained(DIR)`)",
            dir.display()
        )))
    }

    pub fn blank(&self) -> u32 {
        match self {
            Vocabulary::Chars { blank, .. } | Vocabulary::Tokenizer { blank, .. } => *blank,
        }
    }

    /// The text of frame-wise `ids` (one per frame, repeats not yet collapsed).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let kept = collapse(ids, self.blank());
        match self {
            Vocabulary::Tokenizer { tokenizer, .. } => tokenizer.decode(&kept),
            Vocabulary::Chars {
                tokens,
                delimiter,
                lower,
                clean_up,
                ..
            } => {
                let mut text = String::new();
                for id in kept {
                    match tokens.get(&id) {
                        Some(t) if t == delimiter => text.push(' '),
                        Some(t) => text.push_str(t),
                        None => {
                            return Err(Error::invalid_input(format!(
                                "the model gave token {id}, which vocab.json does not have"
                            )))
                        }
                    }
                }
                let mut text = text.trim().to_string();
                if *lower {
                    text = text.to_lowercase();
                }
                if *clean_up {
                    text = clean_up_tokenization(&text);
                }
                Ok(text)
            }
        }
    }
}

/// CTC's collapse: runs of one id become one, then the blank is dropped.
pub fn collapse(ids: &[u32], blank: u32) -> Vec<u32> {
    let mut out = vec![];
    let mut prev = None;
    for &id in ids {
        if prev != Some(id) && id != blank {
            out.push(id);
        }
        prev = Some(id);
    }
    out
}

/// transformers' `clean_up_tokenization`.
fn clean_up_tokenization(text: &str) -> String {
    [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ]
    .iter()
    .fold(text.to_string(), |t, (a, b)| t.replace(a, b))
}

/// The index of the largest value of each row of `logits` (`rows` × `vocab`),
/// the first of equals.
pub fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks_exact(vocab.max(1))
        .map(|row| {
            row.iter()
                .enumerate()
                .fold(0, |b, (i, &x)| if x > row[b] { i } else { b }) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapse_keeps_repeats_split_by_a_blank() {
        // "hello": l, l with a blank between stays two
        assert_eq!(
            collapse(&[0, 3, 3, 4, 0, 5, 5, 0, 5, 6, 6, 0], 0),
            vec![3, 4, 5, 5, 6]
        );
        assert_eq!(collapse(&[0, 0, 0], 0), Vec::<u32>::new());
    }

    #[test]
    fn chars_decode_as_wav2vec2() {
        let tokens: HashMap<u32, String> = [(0, "<pad>"), (1, "|"), (2, "A"), (3, "B"), (4, ".")]
            .into_iter()
            .map(|(i, t)| (i, t.to_string()))
            .collect();
        let vocab = Vocabulary::Chars {
            tokens,
            blank: 0,
            delimiter: "|".into(),
            lower: true,
            clean_up: true,
        };
        let text = vocab.decode(&[1, 2, 2, 0, 2, 1, 1, 3, 1, 4, 1]).unwrap();
        assert_eq!(text, "aa b.");
        assert!(vocab.decode(&[9]).unwrap_err().is_user_error());
    }

    #[test]
    fn argmax_takes_the_first_largest() {
        assert_eq!(argmax_rows(&[0.0, 2.0, 2.0, 5.0, 1.0, 0.0], 3), vec![1, 0]);
    }
}
