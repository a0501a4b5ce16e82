//! The blocked matrix product: the values of one single-threaded gemm call, bit for bit,
//! however many threads cut the output (pools of 1, 2, 3 and 5 threads), along rows and along
//! columns, transposed operands, accumulating or not, at shapes where a careless cut would put
//! a block on another of gemm's paths; wrong lengths one error.

use ft_kernels::gemm_blocks::{product, Mat};

/// Deterministic values in [-1, 1) with all mantissa bits in play.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn any_cut_gives_the_single_call_values_bit_for_bit() {
    // (m, n, k): cut along columns, along rows, an odd long axis, a long inner axis (gemm's
    // inner blocks), one whose halves would have both sides under 65 (gemm's other inner
    // block size: not cut), one whose last block would be short (cut in fewer blocks), a short
    // side of 5, one too small to cut.
    for (i, &(m, n, k)) in [
        (64, 1030, 576),
        (1000, 72, 200),
        (333, 129, 1500),
        (48, 96, 1000),
        (70, 150, 600),
        (5, 900, 700),
        (16, 40, 8),
    ]
    .iter()
    .enumerate()
    {
        for (lt, rt) in [(false, false), (true, false), (false, true)] {
            for accumulate in [false, true] {
                let seed = 10 * i as u64;
                let (a, b, c0) = (
                    values(m * k, seed),
                    values(k * n, seed + 1),
                    values(m * n, seed + 2),
                );
                let run = |threads: usize, cut: bool| {
                    let mut c = c0.clone();
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .expect("a thread pool");
                    pool.install(|| {
                        product(
                            &mut c,
                            Mat::new(&a, lt),
                            Mat::new(&b, rt),
                            m,
                            n,
                            k,
                            accumulate,
                            cut,
                        )
                    })
                    .expect("lengths fit the shape");
                    c
                };
                let one = run(1, false);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for threads in [2, 3, 5] {
                    assert_eq!(
                        bits(&run(threads, true)),
                        bits(&one),
                        "{m}x{n}x{k} transposed {lt}/{rt} accumulate {accumulate}, {threads} threads"
                    );
                }
                assert_ne!(one, c0, "the product changed the output");
            }
        }
    }
}

#[test]
fn wrong_lengths_are_one_error() {
    let (a, b) = (vec![0f32; 6], vec![0f32; 6]);
    let mut c = vec![0f32; 3];
    let err = product(
        &mut c,
        Mat::new(&a, false),
        Mat::new(&b, false),
        2,
        3,
        3,
        false,
        true,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("2x3 by 3x3"), "{err}");
}
