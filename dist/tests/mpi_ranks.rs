//! The collectives over MPI, on 2 and 3 ranks started by `mpirun` (the test starts it on its
//! own executable; each rank runs `rank_body`). Needs the `mpi` feature and an `mpirun` on
//! PATH: without one the test says so and passes, unless `FT_REQUIRE_MPI=1` (CI) makes that a
//! failure.
#![cfg(feature = "mpi")]

mod common;

use ft_dist::Comm;

/// Every collective against its value on `world` ranks; run by each rank under `mpirun`.
#[test]
#[ignore = "run by each rank under mpirun: see collectives_over_mpi_on_2_and_3_ranks"]
fn rank_body() -> anyhow::Result<()> {
    let c = Comm::from_env()?;
    let (r, w) = (c.rank(), c.world());
    assert!(w > 1, "started outside mpirun");
    assert!(c.local_rank() < w);
    let tri = |n: usize| n * (n + 1) / 2;

    let mut x = [r as f32, 1.0, (r * r) as f32];
    c.all_reduce_sum(&mut x)?;
    let squares: usize = (0..w).map(|q| q * q).sum();
    assert_eq!(x, [tri(w - 1) as f32, w as f32, squares as f32]);
    let mut y = [r as f64 + 0.5, -(r as f64)];
    c.all_reduce_sum(&mut y)?;
    assert_eq!(
        y,
        [tri(w - 1) as f64 + 0.5 * w as f64, -(tri(w - 1) as f64)]
    );
    let mut n = [1u64 << 40, r as u64];
    c.all_reduce_sum(&mut n)?;
    assert_eq!(n, [(1u64 << 40) * w as u64, tri(w - 1) as u64]);

    // Two values a rank: rank q sends (q + 1) * (j + 1) at position j; rank r gets positions
    // 2r and 2r + 1 summed over the ranks.
    let send: Vec<f32> = (0..2 * w).map(|j| ((r + 1) * (j + 1)) as f32).collect();
    let mut mine = [0f32; 2];
    c.reduce_scatter_sum(&send, &mut mine)?;
    assert_eq!(
        mine,
        [((2 * r + 1) * tri(w)) as f32, ((2 * r + 2) * tri(w)) as f32]
    );

    // Summed into the last rank's buffer alone.
    let mut z = [r as f32 + 1.0, 2.0];
    c.reduce_sum(&mut z, w - 1)?;
    let want = if r == w - 1 {
        [tri(w) as f32, 2.0 * w as f32]
    } else {
        [r as f32 + 1.0, 2.0]
    };
    assert_eq!(z, want);

    let mut all = vec![0u64; 2 * w];
    c.all_gather(&[10 * r as u64, 10 * r as u64 + 1], &mut all)?;
    let want: Vec<u64> = (0..w as u64).flat_map(|q| [10 * q, 10 * q + 1]).collect();
    assert_eq!(all, want);

    // Point to point: every rank past 0 sends rank 0 its own values, which rank 0 takes in
    // rank order; a shorter message than the buffer is an error, not a partial read.
    if r == 0 {
        for q in 1..w {
            let mut got = [0f32; 2];
            c.recv(&mut got, q)?;
            assert_eq!(got, [q as f32, 0.5 * q as f32]);
        }
        let mut longer = [0u64; 3];
        assert!(
            c.recv(&mut longer, 1).is_err(),
            "a 2-value message taken as 3"
        );
    } else {
        c.send(&[r as f32, 0.5 * r as f32], 0)?;
        if r == 1 {
            c.send(&[1u64, 2], 0)?;
        }
    }
    assert!(c.send(&[0u8], r).is_err(), "a send to itself");

    let mut b = if r == w - 1 { [7u8, 8, 9] } else { [0u8; 3] };
    c.broadcast(&mut b, w - 1)?;
    assert_eq!(b, [7, 8, 9]);
    c.barrier();

    c.agree("the configuration", b"lr = 1e-4")?;
    let mine = if r == 1 { "lr = 1e-5" } else { "lr = 1e-4" };
    let e = c
        .agree("the configuration", mine.as_bytes())
        .err()
        .ok_or_else(|| anyhow::anyhow!("rank {r}: a disagreement passed"))?
        .to_string();
    assert!(e.contains("rank 1 differs from rank 0"), "{e}");
    common::finished(r)
}

#[test]
fn collectives_over_mpi_on_2_and_3_ranks() -> anyhow::Result<()> {
    for n in [2, 3] {
        if !common::ranks_run(n, "rank_body")? {
            return Ok(());
        }
    }
    Ok(())
}
