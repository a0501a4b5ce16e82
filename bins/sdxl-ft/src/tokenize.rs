//! CLIP's tokenizer for SDXL's two text encoders.
//!
//! SDXL repositories ship `tokenizer/` and `tokenizer_2/` as `vocab.json` + `merges.txt` (the slow
//! tokenizer's files), not `tokenizer.json`, so the pipeline transformers' converter builds is
//! assembled here: NFC, whitespace collapsed, lowercase; CLIP's word regex; byte-level BPE with the
//! `</w>` end-of-word marker. A `tokenizer.json`, when present, is used as it is. Captions become
//! `[bos] ids [eos] pad...`, truncated and padded to `max_length` (77).

use std::path::Path;

use anyhow::{anyhow, Result};
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Lowercase, Replace, Sequence as NormSeq, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSeq;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{SplitDelimiterBehavior, Tokenizer};

/// CLIP's word pattern (from the original `simple_tokenizer.py`).
const CLIP_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

/// A CLIP tokenizer with its special tokens and fixed length.
pub struct ClipTokenizer {
    inner: Tokenizer,
    bos: u32,
    eos: u32,
    pad: u32,
    max_length: usize,
}

/// A special token as `special_tokens_map.json` / `tokenizer_config.json` write it: a string or
/// `{"content": ...}`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    v.as_str().map(str::to_string).or_else(|| {
        v.get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string)
    })
}

impl ClipTokenizer {
    /// Loads the tokenizer in `dir`; `max_length` caps `model_max_length` (the text encoder's
    /// position count).
    pub fn from_dir(dir: &Path, max_length: usize) -> Result<Self> {
        let json = dir.join("tokenizer.json");
        let inner = if json.is_file() {
            Tokenizer::from_file(&json).map_err(|e| anyhow!("{}: {e}", json.display()))?
        } else {
            Self::from_vocab_and_merges(&dir.join("vocab.json"), &dir.join("merges.txt"))?
        };
        // Special tokens: tokenizer_config.json, then special_tokens_map.json, then CLIP's.
        let mut cfg = serde_json::Map::new();
        for f in ["special_tokens_map.json", "tokenizer_config.json"] {
            let p = dir.join(f);
            if p.is_file() {
                if let serde_json::Value::Object(m) =
                    ft_models::error::read_config::<serde_json::Value>(&p)?
                {
                    cfg.extend(m);
                }
            }
        }
        let text_of = |key: &str, default: &str| {
            cfg.get(key)
                .and_then(token_text)
                .unwrap_or_else(|| default.to_string())
        };
        let id_of = |key: &str, default: &str| -> Result<u32> {
            let t = text_of(key, default);
            inner.token_to_id(&t).ok_or_else(|| {
                anyhow!(
                    "{}: the {key} `{t}` is not in the vocabulary",
                    dir.display()
                )
            })
        };
        let bos = id_of("bos_token", "<|startoftext|>")?;
        let eos = id_of("eos_token", "<|endoftext|>")?;
        let pad = id_of("pad_token", "<|endoftext|>")?;
        let mut inner = inner;
        // transformers splits its special tokens out of the text before BPE (which matters for
        // tokenizer_2, whose pad token is `!`: a caption's `!` becomes that token).
        let specials: Vec<tokenizers::AddedToken> = [
            ("bos_token", "<|startoftext|>"),
            ("eos_token", "<|endoftext|>"),
            ("pad_token", "<|endoftext|>"),
        ]
        .iter()
        .map(|(k, d)| tokenizers::AddedToken::from(text_of(k, d), true))
        .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| anyhow!("{}: special tokens: {e}", dir.display()))?;
        let inner = inner;
        let model_max = cfg
            .get("model_max_length")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .unwrap_or(77);
        let max_length = model_max.min(max_length);
        if max_length < 2 {
            return Err(anyhow!(
                "{}: max length {max_length} leaves no room for the start and end tokens",
                dir.display()
            ));
        }
        Ok(ClipTokenizer {
            inner,
            bos,
            eos,
            pad,
            max_length,
        })
    }

    /// The tokenizer transformers' `CLIPConverter` builds from the slow tokenizer's files.
    fn from_vocab_and_merges(vocab: &Path, merges: &Path) -> Result<Tokenizer> {
        for p in [vocab, merges] {
            if !p.is_file() {
                return Err(anyhow!(
                    "{}: not found (a CLIP tokenizer needs tokenizer.json or vocab.json + merges.txt)",
                    p.display()
                ));
            }
        }
        let as_str = |p: &Path| {
            p.to_str()
                .map(str::to_string)
                .ok_or_else(|| anyhow!("{}: not UTF-8", p.display()))
        };
        let bpe = BPE::from_file(&as_str(vocab)?, &as_str(merges)?)
            .end_of_word_suffix("</w>".into())
            .continuing_subword_prefix(String::new())
            .unk_token("<|endoftext|>".into())
            .build()
            .map_err(|e| anyhow!("{} / {}: {e}", vocab.display(), merges.display()))?;
        let mut tok = Tokenizer::new(bpe);
        let ws = Replace::new(
            tokenizers::normalizers::replace::ReplacePattern::Regex(r"\s+".into()),
            " ",
        )
        .map_err(|e| anyhow!("whitespace normaliser: {e}"))?;
        tok.with_normalizer(Some(NormSeq::new(vec![
            NFC.into(),
            ws.into(),
            Lowercase.into(),
        ])))
        .map_err(|e| anyhow!("normaliser: {e}"))?;
        let split = Split::new(
            SplitPattern::Regex(CLIP_PATTERN.into()),
            SplitDelimiterBehavior::Removed,
            true,
        )
        .map_err(|e| anyhow!("CLIP word pattern: {e}"))?;
        tok.with_pre_tokenizer(Some(PreSeq::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ])));
        Ok(tok)
    }

    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// `[bos] ids [eos] pad...` of exactly `max_length` ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing `{text}`: {e}"))?;
        let body = enc.get_ids();
        let n = body.len().min(self.max_length - 2);
        let mut ids = Vec::with_capacity(self.max_length);
        ids.push(self.bos);
        ids.extend_from_slice(&body[..n]);
        ids.push(self.eos);
        ids.resize(self.max_length, self.pad);
        Ok(ids)
    }
}
