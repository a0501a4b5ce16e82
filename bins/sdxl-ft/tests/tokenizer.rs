//! The CLIP tokenizer built from vocab.json + merges.txt (SDXL's layout) against transformers'
//! CLIPTokenizer and CLIPTokenizerFast (fixture from scripts/clip_tokenizer_parity.py).

use std::path::{Path, PathBuf};

use sdxl_ft::tokenize::ClipTokenizer;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/clip_tokenizer")
}

#[test]
fn ids_match_transformers_for_both_pad_tokens() -> anyhow::Result<()> {
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("cases.json"))?)?;
    let max = cases["max_length"].as_u64().unwrap_or(0) as usize;
    let tmp = std::env::temp_dir().join(format!("sdxl-tok-{}", std::process::id()));
    let mut checked = 0;
    for pad in ["<|endoftext|>", "!"] {
        std::fs::create_dir_all(&tmp)?;
        for f in ["vocab.json", "merges.txt"] {
            std::fs::copy(fixture().join(f), tmp.join(f))?;
        }
        std::fs::write(
            tmp.join("special_tokens_map.json"),
            serde_json::json!({"pad_token": pad, "bos_token": {"content": "<|startoftext|>"}})
                .to_string(),
        )?;
        let tok = ClipTokenizer::from_dir(&tmp, max)?;
        for case in cases["cases"].as_array().into_iter().flatten() {
            if case["pad"] != pad {
                continue;
            }
            let text = case["text"].as_str().unwrap_or_default();
            let want: Vec<u32> = case["ids"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_u64().map(|x| x as u32))
                .collect();
            assert_eq!(tok.encode(text)?, want, "pad {pad}: `{text}`");
            checked += 1;
        }
    }
    std::fs::remove_dir_all(&tmp)?;
    assert_eq!(checked, 12);
    Ok(())
}

#[test]
fn missing_files_and_unknown_special_tokens_are_named() -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!("sdxl-tok-bad-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let e = ClipTokenizer::from_dir(&tmp, 77)
        .err()
        .map(|e| format!("{e:#}"));
    assert!(e.as_deref().unwrap_or("").contains("vocab.json"), "{e:?}");
    for f in ["vocab.json", "merges.txt"] {
        std::fs::copy(fixture().join(f), tmp.join(f))?;
    }
    std::fs::write(
        tmp.join("tokenizer_config.json"),
        r#"{"pad_token": "<pad>"}"#,
    )?;
    let e = ClipTokenizer::from_dir(&tmp, 77)
        .err()
        .map(|e| format!("{e:#}"));
    assert!(e.as_deref().unwrap_or("").contains("<pad>"), "{e:?}");
    std::fs::remove_dir_all(&tmp)?;
    Ok(())
}
