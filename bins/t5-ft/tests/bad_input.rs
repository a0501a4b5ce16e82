//! t5-ft on bad input: one clear error naming the file, line, tensor or setting, and no silent
//! fallback (a model without weights does not train from random ones unless asked).

use std::path::{Path, PathBuf};

use clap::Parser;
use ft_trainer::scratch::Scratch;
use t5_ft::cli::Args;
use t5_ft::run::setup;

fn tmp(tag: &str) -> Scratch {
    Scratch::new(&format!("t5-bad-{tag}"))
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).ok();
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
}

/// t5-ft on `model` with `train`, quiet, writing under `dir/out`, then `extra`.
fn file_args(model: &Path, train: &Path, dir: &Path, extra: &[&str]) -> Args {
    let mut v = vec![
        "t5-ft".to_string(),
        "--model".into(),
        model.display().to_string(),
        "--train-file".into(),
        train.display().to_string(),
        "--quiet".into(),
        "--output-dir".into(),
        dir.join("out").display().to_string(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    Args::parse_from(v)
}

fn setup_err(args: &Args) -> String {
    match setup(args) {
        Ok(_) => panic!("setup should fail"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_input_gets_one_clear_error() -> anyhow::Result<()> {
    let dir = tmp("bad");
    let good = r#"{"input": "reverse: 1 2", "target": "2 1"}"#;
    let bad = write(
        &dir,
        "bad.jsonl",
        &format!("{good}\n{good}\n{{\"input\": \"x\"\n{good}\n"),
    );
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/t5_tiny/flan");
    let base = |train: &Path, extra: &[&str]| file_args(&fixture, train, &dir, extra);
    let e = setup_err(&base(&bad, &[]));
    assert!(e.contains("bad.jsonl:3"), "{e}");
    let s = setup(&base(&bad, &["--skip-bad-lines"]))?;
    assert_eq!(s.task.train.len(), 3);
    assert_eq!(s.task.train.skipped().len(), 1);
    // A session holds its output folder: the next one into it waits for this one to end.
    drop(s);

    let missing_field = write(&dir, "field.jsonl", r#"{"question": "a", "target": "b"}"#);
    let e = setup_err(&base(&missing_field, &[]));
    assert!(e.contains("field.jsonl:1") && e.contains("input"), "{e}");

    let empty = write(&dir, "empty.jsonl", "\n\n");
    let e = setup_err(&base(&empty, &[]));
    assert!(e.contains("empty.jsonl") && e.contains("no records"), "{e}");

    let e = setup_err(&base(&dir.join("absent.jsonl"), &[]));
    assert!(e.contains("absent.jsonl"), "{e}");

    let csv = write(
        &dir,
        "data.csv",
        "input,target\n\"reverse: 1, 2\",\"2 1\"\nreverse: 3 4,4 3\n",
    );
    let s = setup(&base(&csv, &[]))?;
    let ex = s.task.train.read(&[0, 1])?;
    assert_eq!(ex[0].input, "reverse: 1, 2");
    assert_eq!(ex[1].target, "4 3");
    drop(s);
    let csv_bad = write(&dir, "cols.csv", "question,answer\na,b\n");
    let e = setup_err(&base(&csv_bad, &[]));
    assert!(e.contains("cols.csv") && e.contains("input"), "{e}");

    // A model whose embedding is smaller than the tokenizer's vocabulary.
    let small = dir.join("small-model");
    std::fs::create_dir_all(&small)?;
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json"))?)?;
    cfg["vocab_size"] = 10.into();
    std::fs::write(small.join("config.json"), cfg.to_string())?;
    std::fs::copy(fixture.join("tokenizer.json"), small.join("tokenizer.json"))?;
    let mut a = base(&csv, &["--from-scratch"]);
    a.common.model = Some(small.display().to_string());
    let e = setup_err(&a);
    assert!(e.contains("tokenizer") && e.contains("10"), "{e}");

    // A checkpoint whose tensor has the wrong shape names the tensor and file.
    let mut a = base(&csv, &[]);
    std::fs::copy(
        fixture.join("model.safetensors"),
        small.join("model.safetensors"),
    )?;
    cfg["vocab_size"] = 32.into();
    cfg["d_ff"] = 48.into();
    std::fs::write(small.join("config.json"), cfg.to_string())?;
    a.common.model = Some(small.display().to_string());
    let e = setup_err(&a);
    assert!(
        e.contains("DenseReluDense") && e.contains("model.safetensors"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// A model folder with config.json and tokenizer.json but no model.safetensors (only a
/// pytorch_model.bin, say) is an error that names what is missing and what was found, where it
/// used to train from random weights with no word; `--from-scratch` asks for the seed's weights.
#[test]
fn a_model_without_safetensors_is_an_error_unless_from_scratch() -> anyhow::Result<()> {
    let dir = tmp("no-weights");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/t5_tiny/flan");
    let model = dir.join("model");
    std::fs::create_dir_all(&model)?;
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture.join(f), model.join(f))?;
    }
    std::fs::write(model.join("pytorch_model.bin"), b"not read")?;
    let train = write(
        &dir,
        "train.jsonl",
        r#"{"input": "reverse: 1 2", "target": "2 1"}"#,
    );
    let args = |extra: &[&str]| file_args(&model, &train, &dir, extra);
    let e = setup_err(&args(&[]));
    assert!(
        e.contains("model.safetensors") && e.contains("pytorch_model.bin"),
        "{e}"
    );
    let s = setup(&args(&["--from-scratch"]))?;
    assert!(s.task.store.count(true).0 > 0);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// A JSONL line that is not UTF-8 is a bad record with its line number, which
/// `--skip-bad-lines` skips; a byte-order mark at the start of the file is ignored, as CSV's is.
#[test]
fn jsonl_with_invalid_utf8_and_a_byte_order_mark() -> anyhow::Result<()> {
    let dir = tmp("utf8");
    std::fs::create_dir_all(&dir)?;
    let good = br#"{"input": "reverse: 1 2", "target": "2 1"}"#;
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend_from_slice(good);
    bytes.extend_from_slice(b"\n{\"input\": \"x \xFF\xFE\", \"target\": \"y\"}\n");
    bytes.extend_from_slice(good);
    bytes.push(b'\n');
    let path = dir.join("mixed.jsonl");
    std::fs::write(&path, &bytes)?;
    let fields = |skip_bad| t5_ft::data::Fields {
        input: "input".into(),
        target: "target".into(),
        skip_bad,
    };
    let e = t5_ft::data::RecordFile::open(&path, fields(false))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("mixed.jsonl:2") && e.contains("UTF-8"), "{e}");
    let f = t5_ft::data::RecordFile::open(&path, fields(true))?;
    assert_eq!(f.len(), 2, "the BOM line and the last one");
    assert_eq!(f.skipped().len(), 1);
    let ex = f.read(&[0, 1])?;
    assert_eq!(ex[0].input, "reverse: 1 2");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// `--no-shuffle` reads the training records in file order, every epoch; without it the order
/// is shuffled (and differs between epochs).
#[test]
fn no_shuffle_reads_the_file_in_order() -> anyhow::Result<()> {
    let dir = tmp("order");
    std::fs::create_dir_all(&dir)?;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/t5_tiny/flan");
    let lines: String = (0..9)
        .map(|i| format!("{{\"input\": \"reverse: {i}\", \"target\": \"{i}\"}}\n"))
        .collect();
    let train = write(&dir, "train.jsonl", &lines);
    // Each epoch's records, in the order the task reads them.
    let order = |extra: &[&str]| -> anyhow::Result<Vec<Vec<usize>>> {
        let mut v = vec!["--batch-size", "2"];
        v.extend(extra);
        let s = setup(&file_args(&fixture, &train, &dir, &v))?;
        Ok((0..2).map(|e| s.task.order.batches(e).concat()).collect())
    };
    let in_order: Vec<usize> = (0..9).collect();
    let plain = order(&["--no-shuffle"])?;
    assert_eq!(
        plain,
        [in_order.clone(), in_order.clone()],
        "file order, every epoch"
    );
    let shuffled = order(&[])?;
    assert_ne!(shuffled[0], in_order);
    assert_ne!(shuffled[0], shuffled[1]);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
