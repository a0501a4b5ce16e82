//! The epoch order every binary draws its data from: each item once per epoch, reproducible from
//! the seed and the epoch, grouped by length or by bucket as asked, and restored exactly on
//! resume.

use ft_trainer::train::{EpochOrder, Epochs, Grouping};

fn order(items: usize, batch_size: usize, grouping: Grouping) -> EpochOrder {
    EpochOrder {
        items,
        batch_size,
        seed: 7,
        shuffle: true,
        grouping,
    }
}

fn flat(batches: &[Vec<usize>]) -> Vec<usize> {
    let mut v: Vec<usize> = batches.iter().flatten().copied().collect();
    v.sort();
    v
}

#[test]
fn every_item_once_per_epoch_the_same_for_a_seed_and_another_for_the_next_epoch() {
    let lengths: Vec<usize> = (0..103).map(|i| (i * 37) % 50).collect();
    let keys: Vec<Vec<usize>> = (0..103).map(|i| vec![4, 8 + 8 * (i % 3), 8]).collect();
    for g in [
        Grouping::None,
        Grouping::ByLength(lengths),
        Grouping::Buckets(keys),
    ] {
        let o = order(103, 4, g);
        let e0 = o.batches(0);
        assert_eq!(flat(&e0), (0..103).collect::<Vec<_>>(), "{:?}", o.grouping);
        assert_eq!(o.batches(0), e0, "reproducible");
        assert_ne!(o.batches(1), e0, "each epoch its own order");
        assert!(e0.iter().all(|b| !b.is_empty() && b.len() <= 4));
        assert_eq!(o.batches_per_epoch(), e0.len());
    }
}

#[test]
fn buckets_never_mix_and_lengths_are_grouped() {
    let keys: Vec<Vec<usize>> = (0..60).map(|i| vec![i % 3]).collect();
    let o = order(60, 4, Grouping::Buckets(keys.clone()));
    for b in o.batches(2) {
        assert!(
            b.iter().all(|&i| keys[i] == keys[b[0]]),
            "a batch mixes buckets"
        );
    }
    // Within each window of 50 micro-batches the longest come first: a batch's lengths are a
    // run of the window's sorted lengths, so its spread is small.
    let lengths: Vec<usize> = (0..400).map(|i| (i * 7919) % 1000).collect();
    let grouped = order(400, 4, Grouping::ByLength(lengths.clone())).batches(0);
    let plain = order(400, 4, Grouping::None).batches(0);
    let spread = |bs: &[Vec<usize>]| -> usize {
        bs.iter()
            .map(|b| {
                let l: Vec<usize> = b.iter().map(|&i| lengths[i]).collect();
                l.iter().max().unwrap_or(&0) - l.iter().min().unwrap_or(&0)
            })
            .sum()
    };
    assert!(
        spread(&grouped) * 10 < spread(&plain),
        "{} vs {}",
        spread(&grouped),
        spread(&plain)
    );
}

#[test]
fn a_saved_position_resumes_where_the_run_was() -> anyhow::Result<()> {
    let o = order(30, 4, Grouping::None);
    let mut a: Epochs<Vec<usize>> = Epochs::default();
    a.start(3, o.batches(3));
    for _ in 0..5 {
        a.next_item();
    }
    let saved = a.cursor().to_json();
    let mut b: Epochs<Vec<usize>> = Epochs::default();
    b.restore(&saved, |e| o.batches(e))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(b.epoch(), 3);
    while let Some(x) = a.next_item() {
        assert_eq!(b.next_item(), Some(x));
    }
    assert_eq!(b.next_item(), None);
    let e = b
        .restore(&serde_json::json!({"epoch": 1}), |e| o.batches(e))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.cursor"), "{e}");
    Ok(())
}
