//! fewshot-ft as a user runs it on the dataset layouts people have: the built binary, its exit
//! status and stderr. Layouts it refused once (issue 17: no val.csv, ten classes) now train and
//! say how the splits were made; what cannot work is one clear error naming the file or flag.

#[path = "../../../tests/hostile/run.rs"]
mod hostile;

use std::path::Path;

use hostile::{arg, fresh, run, Ran};

const BIN: &str = env!("CARGO_BIN_EXE_fewshot-ft");

/// A small image of class `c`, picture `i`.
fn png(path: &Path, c: usize, i: usize) {
    let img = image::RgbImage::from_fn(20, 20, |x, y| {
        image::Rgb([(c * 40) as u8, (x * 10) as u8 ^ (i as u8), y as u8 * 9])
    });
    img.save(path).expect("png");
}

/// `n` class folders of 4 images each under `dir`.
fn class_folders(dir: &Path, n: usize) {
    for c in 0..n {
        let d = dir.join(format!("class{c:02}"));
        std::fs::create_dir_all(&d).expect("folder");
        for i in 0..4 {
            png(&d.join(format!("{i}.png")), c, i);
        }
    }
}

/// A tiny run on `data` into `out` (2-way unless `extra` says otherwise).
fn on(data: &Path, out: &Path, extra: &[&str]) -> Ran {
    let (data, out) = (arg(data), arg(out));
    let mut v = vec![
        "--data-dir",
        &data,
        "--output-dir",
        &out,
        "--quiet",
        "--image-size",
        "20",
        "--k-shot",
        "1",
        "--n-query",
        "2",
        "--n-episode",
        "2",
        "--epochs",
        "1",
    ];
    for (flag, value) in [
        ("--n-way", "2"),
        ("--val-episodes", "2"),
        ("--test-episodes", "3"),
    ] {
        if !extra.contains(&flag) {
            v.extend([flag, value]);
        }
    }
    v.extend_from_slice(extra);
    run(BIN, &v)
}

#[test]
fn ten_class_folders_train_and_say_their_split() {
    let dir = fresh("fewshot", "ten");
    let data = dir.join("data");
    class_folders(&data, 10);
    on(&data, &dir.join("o1"), &[])
        .succeeds()
        .says("10 classes split by --seed into 6 train, 2 validation and 2 test classes");
    // Five-way cannot make three disjoint splits of ten classes: the error says what would.
    on(&data, &dir.join("o2"), &["--n-way", "5"]).fails_naming(&[
        "10 class folders",
        "--n-way",
        "--val-episodes 0",
    ]);
    on(
        &data,
        &dir.join("o3"),
        &["--n-way", "5", "--val-episodes", "0"],
    )
    .succeeds()
    .says("testing the last model");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_csv_dataset_without_val_csv_validates_on_carved_classes() -> anyhow::Result<()> {
    let dir = fresh("fewshot", "csv");
    let data = dir.join("mini");
    let images = data.join("images");
    std::fs::create_dir_all(&images)?;
    let mut rows = std::collections::BTreeMap::<&str, String>::new();
    for c in 0..10 {
        let split = if c < 6 { "train" } else { "test" };
        for i in 0..4 {
            let f = format!("n{c:02}_{i}.png");
            png(&images.join(&f), c, i);
            rows.entry(split)
                .or_insert_with(|| "filename,label\n".into())
                .push_str(&format!("{f},n{c:02}\n"));
        }
    }
    for (split, text) in &rows {
        std::fs::write(data.join(format!("{split}.csv")), text)?;
    }
    on(&data, &dir.join("o1"), &[])
        .succeeds()
        .says("no val.csv: 2 of the 6 training classes");
    // A malformed line and an unreadable image name the file (and line).
    std::fs::write(
        data.join("test.csv"),
        format!("{}only_one_field\n", rows["test"]),
    )?;
    on(&data, &dir.join("o2"), &[]).fails_naming(&["test.csv:18"]);
    std::fs::write(data.join("test.csv"), &rows["test"])?;
    // Images decode as episodes draw them: every training class has a broken one.
    for c in 0..6 {
        std::fs::write(images.join(format!("n{c:02}_1.png")), b"not a png")?;
    }
    on(&data, &dir.join("o3"), &[]).fails_naming(&["_1.png", "cannot read image"]);
    on(&data, &dir.join("o4"), &["--test-episodes", "0"]).fails_naming(&["--test-episodes"]);
    on(&dir.join("absent"), &dir.join("o5"), &[]).fails_naming(&["absent"]);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
