//! Multi-turn chat with a decoder program: what `etmetal chat` runs.
//!
//! The conversation is rendered with the model's own chat template (the
//! `chat_template` of `tokenizer_config.json`, or `chat_template.jinja`
//! beside it, as transformers saves them) by minijinja, set up as
//! transformers sets up Jinja for `apply_chat_template`: `trim_blocks`,
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`,
//! `tojson`, and Python's string and dict methods (minijinja-contrib's
//! pycompat). The rendered text is tokenized without adding special tokens
//! (the template writes them), as `apply_chat_template(tokenize=True)`.
//!
//! The KV cache is kept across turns: each turn's rendering is compared
//! with the tokens the cache holds, and only what follows their common
//! prefix is run (the new user turn, and whatever the template writes
//! around the last reply that the model did not generate itself).

use std::path::{Path, PathBuf};
use std::time::Instant;

use etmetal_core::{Error, Result};
use minijinja::{Environment, ErrorKind as JinjaErrorKind, Value};

use crate::generate::{
    Decoder, DecoderMethods, Options, Sampler, Stats, TextStream, TextTokenizer,
};
use crate::Model;

/// One message of the conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A tokenizer folder's chat template, with the special tokens it names.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... of tokenizer_config.json.
    tokens: Vec<(String, String)>,
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

fn jinja_error(what: &str, e: minijinja::Error) -> Error {
    // a template's raise_exception is the template's own message
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text += &format!(": {s}");
        source = s.source();
    }
    Error::invalid_input(format!("{what}: {text}"))
}

impl ChatTemplate {
    /// The template of the tokenizer folder `dir`: `chat_template.jinja`,
    /// else `tokenizer_config.json`'s `chat_template` (a string, or a list
    /// of named templates, of which `default` is taken).
    pub fn load(dir: &Path) -> Result<ChatTemplate> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?.unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match &config["chat_template"] {
                serde_json::Value::String(t) => t.clone(),
                serde_json::Value::Array(list) => list
                    .iter()
                    .find(|t| t["name"] == "default")
                    .or_else(|| list.first())
                    .and_then(|t| t["template"].as_str())
                    .unwrap_or_default()
                    .to_string(),
                _ => String::new(),
            },
            Err(e) => return Err(Error::io(jinja.display(), e)),
        };
        if source.trim().is_empty() {
            return Err(Error::invalid_input(format!(
                "{}: the tokenizer has no chat template (neither chat_template.jinja nor a \
                 `chat_template` in tokenizer_config.json): chat needs the model's template",
                dir.display()
            )));
        }
        let tokens = [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ]
        .iter()
        .filter_map(|&name| {
            let v = &config[name];
            let text = v.as_str().or_else(|| v["content"].as_str())?;
            Some((name.to_string(), text.to_string()))
        })
        .collect();
        ChatTemplate::from_source(source, tokens)
            .map_err(|e| e.context(format!("the chat template of {}", dir.display())))
    }

    /// A template from its text and the special tokens it may name.
    pub fn from_source(source: String, tokens: Vec<(String, String)>) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| jinja_error("the template syntax", e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    JinjaErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source)
            .map_err(|e| jinja_error("the chat template does not parse", e))?;
        Ok(ChatTemplate { env, tokens })
    }

    /// The text of `messages`, with the prompt of the model's next turn
    /// when `add_generation_prompt` (as `apply_chat_template`).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| jinja_error("the chat template", e))?;
        // maps keep their keys' order (`preserve_order`), as Python dicts
        let map = |pairs: Vec<(String, Value)>| Value::from_pairs(pairs);
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                map(vec![
                    ("role".into(), Value::from(m.role.as_str())),
                    ("content".into(), Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let mut ctx: Vec<(String, Value)> = self
            .tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.push(("messages".into(), Value::from(messages)));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        template
            .render(map(ctx))
            .map_err(|e| jinja_error("rendering the chat template", e))
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, as
/// transformers' `tojson` writes it (`", "` and `": "` between items,
/// keys in their order), where minijinja's own is compact.
fn tojson(value: &Value, indent: Option<usize>) -> std::result::Result<Value, minijinja::Error> {
    let mut out = String::new();
    write_json(value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let (open, sep, close) = match indent {
        Some(n) => (
            format!("\n{}", " ".repeat(n * (depth + 1))),
            format!(",\n{}", " ".repeat(n * (depth + 1))),
            format!("\n{}", " ".repeat(n * depth)),
        ),
        None => (String::new(), ", ".to_string(), String::new()),
    };
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String | ValueKind::Bytes => {
            out.push_str(&quote(v.as_str().unwrap_or_default()))
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            out.push_str(&open);
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&sep);
                }
                out.push_str(&quote(&k.to_string()));
                out.push_str(": ");
                write_json(&v.get_item(k)?, indent, depth + 1, out)?;
            }
            out.push_str(&close);
            out.push('}');
        }
        _ => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            out.push_str(&open);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&sep);
                }
                write_json(item, indent, depth + 1, out)?;
            }
            out.push_str(&close);
            out.push(']');
        }
    }
    Ok(())
}

/// Today's date in `format` (the subset of strftime that templates use:
/// `%d %b %Y`, `%Y-%m-%d`, `%B`, `%A`...), UTC.
fn strftime_now(format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let days = secs.div_euclid(86400);
    // civil-from-days (H. Hinnant)
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (month, weekday) = (MONTHS[(m - 1) as usize], DAYS[days.rem_euclid(7) as usize]);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out += &format!("{d:02}"),
            Some('m') => out += &format!("{m:02}"),
            Some('Y') => out += &y.to_string(),
            Some('y') => out += &format!("{:02}", y % 100),
            Some('b') => out += &month[..3],
            Some('B') => out += month,
            Some('a') => out += &weekday[..3],
            Some('A') => out += weekday,
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Chat settings.
#[derive(Clone, Debug)]
pub struct ChatOptions {
    /// Tokens, stopping, sampling (as `generate`): per reply.
    pub generation: Options,
    /// Texts that end a reply (from generation_config.json's `stop_strings`
    /// and `--stop`); the reply is cut before one.
    pub stop: Vec<String>,
    pub system: Option<String>,
}

/// The stop strings of a tokenizer folder's `generation_config.json`.
pub fn configured_stop_strings(dir: &Path) -> Result<Vec<String>> {
    let config = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
    Ok(match &config["stop_strings"] {
        serde_json::Value::String(s) => vec![s.clone()],
        serde_json::Value::Array(list) => list
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
        _ => vec![],
    })
}

/// A conversation with a loaded decoder: its messages and the decoder
/// whose cache holds the conversation so far.
pub struct Chat {
    template: ChatTemplate,
    tokenizer: TextTokenizer,
    options: ChatOptions,
    messages: Vec<Message>,
    decoder: Decoder,
    sampler: Sampler,
}

/// What one turn did.
#[derive(Clone, Debug, Default)]
pub struct TurnStats {
    /// Tokens the turn ran before its reply (the rest was in the cache).
    pub prefilled: usize,
    /// Tokens of the conversation the cache held already.
    pub reused: usize,
    pub prefill_seconds: f64,
    pub decode: Stats,
    pub reply_tokens: usize,
}

impl TurnStats {
    pub fn line(&self) -> String {
        let rate = |n: usize, s: f64| n as f64 / s.max(1e-9);
        format!(
            "prefill: {} new tokens in {:.3} s ({:.1} tokens/s; {} from the cache); reply: {} tokens in {:.3} s ({:.1} tokens/s)",
            self.prefilled,
            self.prefill_seconds,
            rate(self.prefilled, self.prefill_seconds),
            self.reused,
            self.reply_tokens,
            self.decode.decode_seconds,
            rate(self.decode.decode_tokens, self.decode.decode_seconds),
        )
    }
}

impl Chat {
    /// A conversation over `model` (its state reset), with the template,
    /// tokenizer.json and generation config of the folder `dir`.
    pub fn new(model: &mut Model, dir: &Path, options: ChatOptions) -> Result<Chat> {
        let template = ChatTemplate::load(dir)?;
        let tokenizer = TextTokenizer::load(&tokenizer_json(dir)?)?;
        let greedy = options.generation.sampling.temperature <= 0.0;
        let decoder = Decoder::new(model, &DecoderMethods::LM, greedy)?;
        model.reset_state()?;
        let mut messages = vec![];
        if let Some(system) = &options.system {
            messages.push(Message::new("system", system));
        }
        let sampler = Sampler::new(options.generation.sampling);
        Ok(Chat {
            template,
            tokenizer,
            options,
            messages,
            decoder,
            sampler,
        })
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The user says `text`; the reply is streamed to `on_text` piece by
    /// piece and returned (cut before a stop string, special tokens left
    /// out, as `decode(ids, skip_special_tokens=True)`), and both join the
    /// conversation.
    pub fn turn(
        &mut self,
        model: &mut Model,
        text: &str,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<(String, TurnStats)> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", text));
        let rendered = self.template.render(&messages, true)?;
        let ids = self.tokenizer.encode_plain(&rendered)?;
        if ids.is_empty() {
            return Err(Error::invalid_input("the chat template rendered no tokens"));
        }
        if let Some(c) = self.decoder.capacity().filter(|&c| ids.len() >= c) {
            return Err(Error::invalid_input(format!(
                "the conversation has {} tokens, and the KV cache holds {c} positions: \
                 start a new chat (or export with a longer cache)",
                ids.len()
            )));
        }
        // the cache keeps the common prefix (where the program's state can
        // go back to it: none of a recurrent state); at least one token is run
        let held = self.decoder.tokens();
        let common = held.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        let common = self.decoder.rewind(common.min(ids.len() - 1));
        let mut stats = TurnStats {
            prefilled: ids.len() - common,
            reused: common,
            ..TurnStats::default()
        };
        let t0 = Instant::now();
        let next = self.decoder.feed(model, &ids[common..])?;
        stats.prefill_seconds = t0.elapsed().as_secs_f64();
        let mut reply_ids: Vec<u32> = vec![];
        let mut stream = TextStream::new(&[]);
        let mut shown = String::new();
        let mut held_back = String::new();
        let stops = self.options.stop.clone();
        let tokenizer = &self.tokenizer;
        let longest = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut stopped = false;
        let decode = self.decoder.generate(
            model,
            next,
            &self.options.generation,
            &mut self.sampler,
            &mut |id| {
                reply_ids.push(id);
                held_back += &stream.push(tokenizer, id)?;
                if let Some(cut) = stops
                    .iter()
                    .filter_map(|s| held_back.find(s.as_str()))
                    .min()
                {
                    held_back.truncate(cut);
                    stopped = true;
                }
                // what cannot begin a stop string any more is shown
                let keep = if stopped {
                    0
                } else {
                    longest.saturating_sub(1)
                };
                let mut split = held_back.len().saturating_sub(keep);
                while !held_back.is_char_boundary(split) {
                    split -= 1;
                }
                let out: String = held_back.drain(..split).collect();
                if !out.is_empty() {
                    on_text(&out)?;
                    shown += &out;
                }
                Ok(!stopped)
            },
        )?;
        if !stopped {
            held_back += &stream.finish(tokenizer)?;
            if !held_back.is_empty() {
                on_text(&held_back)?;
                shown += &held_back;
            }
        }
        stats.reply_tokens = reply_ids.len();
        stats.decode = decode;
        messages.push(Message::new("assistant", &shown));
        self.messages = messages;
        Ok((shown, stats))
    }
}

/// The tokenizer.json of a tokenizer folder (or the file itself).
pub fn tokenizer_json(dir: &Path) -> Result<PathBuf> {
    let path = if dir.is_dir() {
        dir.join("tokenizer.json")
    } else {
        dir.to_path_buf()
    };
    if !path.is_file() {
        return Err(Error::invalid_input(format!(
            "{}: no tokenizer.json (save the tokenizer with `tokenizer.save_pretrained(DIR)`)",
            dir.display()
        )));
    }
    Ok(path)
}

/// The folder a `--tokenizer` argument names (a folder, or a file in it).
pub fn tokenizer_dir(arg: &Path) -> PathBuf {
    if arg.is_dir() {
        arg.to_path_buf()
    } else {
        arg.parent().unwrap_or(Path::new(".")).to_path_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Gemma 3's template, as the parity suite gives it to Gemma 3 270M
    const GEMMA: &str = include_str!("../../../tests/parity/data/gemma3_chat_template.jinja");

    fn gemma() -> ChatTemplate {
        ChatTemplate::from_source(GEMMA.into(), vec![("bos_token".into(), "<bos>".into())]).unwrap()
    }

    #[test]
    fn renders_as_transformers() {
        let t = gemma();
        let text = t
            .render(
                &[
                    Message::new("system", "Be brief."),
                    Message::new("user", " Hi "),
                    Message::new("assistant", "Hello."),
                    Message::new("user", "Bye"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn raise_exception_is_the_error() {
        let t = gemma();
        let e = t
            .render(&[Message::new("assistant", "x")], true)
            .unwrap_err();
        assert!(e.is_user_error());
        assert!(
            e.to_string().contains("Conversation roles must alternate"),
            "{e}"
        );
    }

    #[test]
    fn python_methods_and_tojson() {
        let t = ChatTemplate::from_source(
            "{% for m in messages %}{{ m['content'].strip().upper() }}|{{ m | tojson }}{% endfor %}".into(),
            vec![],
        )
        .unwrap();
        let text = t.render(&[Message::new("user", "  hi ")], false).unwrap();
        assert_eq!(text, r#"HI|{"role": "user", "content": "  hi "}"#);
    }

    #[test]
    fn no_template_is_named() {
        let dir = std::env::temp_dir().join(format!("etmetal-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "</s>"}"#,
        )
        .unwrap();
        let e = ChatTemplate::load(&dir).err().unwrap();
        assert!(
            e.is_user_error() && e.to_string().contains("no chat template"),
            "{e}"
        );
    }

    #[test]
    fn strftime_now_formats_a_date() {
        let s = strftime_now("%d %b %Y");
        assert_eq!(s.len(), 11, "{s}");
        assert!(strftime_now("%Y-%m-%d").starts_with("20"));
    }
}
