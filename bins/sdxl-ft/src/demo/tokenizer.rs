//! CLIP-layout BPE tokenizer files (vocab.json, merges.txt, special tokens) for the demo's
//! handful of caption words, so the demo tokenizes through the same loader as a real model.

use std::path::Path;

use anyhow::Result;
use serde_json::json;

/// GPT-2's byte-to-character table that CLIP's BPE vocabulary is written in.
fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap_or(' ');
    }
    table
}

/// A CLIP-layout tokenizer (vocab.json, merges.txt, special tokens) whose merges spell `words`.
pub(super) fn write_tokenizer(dir: &Path, words: &[&str], pad: &str) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut vocab = serde_json::Map::new();
    let add = |t: String, vocab: &mut serde_json::Map<String, serde_json::Value>| {
        if !vocab.contains_key(&t) {
            let id = vocab.len();
            vocab.insert(t, json!(id));
        }
    };
    let chars = bytes_to_unicode();
    for c in &chars {
        add(c.to_string(), &mut vocab);
    }
    for c in &chars {
        add(format!("{c}</w>"), &mut vocab);
    }
    let mut merges: Vec<String> = Vec::new();
    for w in words {
        let mut symbols: Vec<String> = w.chars().map(|c| c.to_string()).collect();
        if let Some(last) = symbols.last_mut() {
            last.push_str("</w>");
        }
        let mut cur = symbols[0].clone();
        for s in &symbols[1..] {
            let pair = format!("{cur} {s}");
            if !merges.contains(&pair) {
                merges.push(pair);
            }
            cur.push_str(s);
            add(cur.clone(), &mut vocab);
        }
    }
    add("<|startoftext|>".into(), &mut vocab);
    add("<|endoftext|>".into(), &mut vocab);
    std::fs::write(
        dir.join("vocab.json"),
        serde_json::Value::Object(vocab).to_string(),
    )?;
    std::fs::write(
        dir.join("merges.txt"),
        format!("#version: 0.2\n{}\n", merges.join("\n")),
    )?;
    std::fs::write(
        dir.join("special_tokens_map.json"),
        json!({"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
               "pad_token": pad, "unk_token": "<|endoftext|>"})
        .to_string(),
    )?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"model_max_length": 77, "tokenizer_class": "CLIPTokenizer"}).to_string(),
    )?;
    Ok(())
}
