//! The blocked matrix product: the values of one single-threaded gemm call, bit for bit,
//! however many threads cut the output (pools of 1, 2, 3 and 5 threads), along rows and along
//! columns, transposed operands, accumulating or not, at shapes where a careless cut would put
//! a block on another of gemm's paths; wrong lengths one error. Products written side by side
//! into one matrix's column blocks give each block's own product's values.

use ft_kernels::gemm_blocks::{column_blocks, product, Mat};

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

/// `column_blocks`: each block's product (twice, the second accumulating, as a convolution's
/// weight gradient sums its groups of images) written into its columns of one matrix gives the
/// values of the same products into matrices of their own, bit for bit, on 1 to 3 threads and
/// with the blocks' products cut or not: blocks cut along their rows (rows `ldd` apart, wider
/// than the block) and along their columns, a last block one column wide, and an empty inner
/// dimension (zeros written, the other blocks' columns left alone).
#[test]
fn column_blocks_give_each_blocks_own_product() {
    // (m, ldd, k, width): uncut blocks; 300 rows cut along rows; 70 rows of 256-wide blocks cut
    // along columns; 129 columns in blocks of 64 (the last one column); k = 0.
    for (m, ldd, k, width) in [
        (70usize, 300usize, 450usize, 64usize),
        (300, 300, 450, 128),
        (70, 300, 450, 256),
        (70, 129, 450, 64),
        (30, 100, 0, 40),
    ] {
        let blocks = ldd.div_ceil(width);
        let (a1, a2) = (values(m * k, 1), values(m * k, 2));
        let rhs: Vec<(Vec<f32>, Vec<f32>)> = (0..blocks)
            .map(|i| {
                let n = width.min(ldd - i * width);
                (values(n * k, 10 + i as u64), values(n * k, 50 + i as u64))
            })
            .collect();
        // Each block's product in a matrix of its own (NaN first: k = 0 must write zeros),
        // then placed.
        let mut want = vec![0f32; m * ldd];
        for (i, (b1, b2)) in rhs.iter().enumerate() {
            let n = width.min(ldd - i * width);
            let mut own = vec![f32::NAN; m * n];
            for (a, b, accumulate) in [(&a1, b1, false), (&a2, b2, true)] {
                let (lhs, rhs) = (Mat::new(a, false), Mat::new(b, true));
                product(&mut own, lhs, rhs, m, n, k, accumulate, false).expect("lengths fit");
            }
            for (row, src) in want.chunks_mut(ldd).zip(own.chunks(n)) {
                row[i * width..][..n].copy_from_slice(src);
            }
        }
        assert!(want.iter().all(|v| v.is_finite()), "{m}x{ldd}x{k}");
        for (threads, cut) in [(1, false), (2, true), (3, true), (2, false)] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            let mut got = vec![f32::NAN; m * ldd];
            pool.install(|| {
                column_blocks(
                    &mut got,
                    (m, ldd),
                    width,
                    || (),
                    |_, i, mut block| {
                        let (b1, b2) = &rhs[i];
                        block.product(Mat::new(&a1, false), Mat::new(b1, true), k, false, cut)?;
                        block.product(Mat::new(&a2, false), Mat::new(b2, true), k, true, cut)
                    },
                )
            })
            .expect("lengths fit");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "{m}x{ldd}x{k} in blocks of {width}, {threads} threads, cut {cut}"
            );
        }
    }
}

/// A matrix too large for its values, or a shape whose size overflows, is one error, not a
/// product written past the end.
#[test]
fn column_blocks_check_lengths() {
    let mut dst = vec![0f32; 10];
    let err = column_blocks(&mut dst, (3, 4), 2, || (), |_, _, _| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 rows of 4"), "{err}");
    let err = column_blocks(
        &mut dst,
        (usize::MAX / 2 + 1, 2),
        2,
        || (),
        |_, _, _| Ok(()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("rows of 2"), "{err}");
    let (a, b) = (vec![0f32; 4], vec![0f32; 4]);
    let mut dst = vec![0f32; 4];
    let err = column_blocks(
        &mut dst,
        (2, 2),
        2,
        || (),
        |_, _, mut block| block.product(Mat::new(&a, false), Mat::new(&b, false), 3, false, true),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("2x3 by 3x2"), "{err}");
}

/// An operand whose stored rows are `ld` values apart (`Mat::rows_apart`, the convolution's
/// weight gradient's columns laid out by `spread_rows`) gives the packed operand's product
/// bit for bit, transposed or not, on either side; the values between the rows are never
/// read (NaN there would show); lengths that do not reach the last row, and rows closer than
/// their length, are one error.
#[test]
fn operands_with_rows_apart_give_the_packed_values() {
    use ft_kernels::gemm_blocks::spread_rows;
    // (m, n, k): rows of 1024 values (a 32x32 plane: 64 lines apart), 441, and a short one.
    for (i, &(m, n, k)) in [(64, 72, 1024), (64, 30, 441), (20, 9, 7)]
        .iter()
        .enumerate()
    {
        let seed = 100 + i as u64;
        let (a, b) = (values(m * k, seed), values(k * n, seed + 1));
        for (lt, rt) in [(false, false), (true, false), (false, true), (true, true)] {
            let packed = |threads| {
                let mut c = vec![0f32; m * n];
                product(
                    &mut c,
                    Mat::new(&a, lt),
                    Mat::new(&b, rt),
                    m,
                    n,
                    k,
                    false,
                    threads,
                )
                .expect("lengths fit");
                c
            };
            // The stored rows of `v` (`rows` of `len`) moved `ld` apart, NaN between.
            let spread = |v: &[f32], rows: usize, len: usize| {
                let ld = spread_rows::<f32>(len);
                assert!(ld >= len && (ld * 4).is_multiple_of(64) && (ld * 4 / 64) % 2 == 1);
                let mut out = vec![f32::NAN; (rows - 1) * ld + len];
                for r in 0..rows {
                    out[r * ld..][..len].copy_from_slice(&v[r * len..][..len]);
                }
                (out, ld)
            };
            let (sa, la) = if lt {
                spread(&a, k, m)
            } else {
                spread(&a, m, k)
            };
            let (sb, lb) = if rt {
                spread(&b, n, k)
            } else {
                spread(&b, k, n)
            };
            for threads in [false, true] {
                let mut c = vec![0f32; m * n];
                product(
                    &mut c,
                    Mat::rows_apart(&sa, lt, la),
                    Mat::rows_apart(&sb, rt, lb),
                    m,
                    n,
                    k,
                    false,
                    threads,
                )
                .expect("lengths fit");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&c),
                    bits(&packed(threads)),
                    "{m}x{n}x{k} transposed {lt}/{rt}"
                );
            }
            // One value short of the last stored row, and rows closer than their length.
            let mut c = vec![0f32; m * n];
            let short = Mat::rows_apart(&sa[..sa.len() - 1], lt, la);
            assert!(product(&mut c, short, Mat::new(&b, rt), m, n, k, false, false).is_err());
            let close = Mat::rows_apart(&a, lt, if lt { m - 1 } else { k - 1 });
            assert!(product(&mut c, close, Mat::new(&b, rt), m, n, k, false, false).is_err());
        }
    }
}
