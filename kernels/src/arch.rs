//! Which virtual architecture the CUDA kernels are compiled for, as a pure function of the
//! GPU's compute capability, so that the choice is tested on machines without a GPU (the
//! `cuda` module asks the driver for the capability and calls these).

/// The NVRTC target for a GPU of compute capability `cc` (`None` when the driver could not
/// say): `compute_80` on every sm_80+ GPU, because the tensor-core kernels need `mma.sync` and
/// the driver JIT-compiles that PTX for later GPUs; else the GPU's own (`compute_75` on a T4).
/// Never NVRTC's default, which is `compute_52` for NVRTC 12, where the double-precision
/// `atomicAdd` does not exist and which an older GPU could not run anyway.
pub fn arch_for(cc: Option<(i32, i32)>) -> String {
    match cc {
        Some((major, _)) if major >= 8 => "compute_80".into(),
        Some((major, minor)) => format!("compute_{major}{minor}"),
        None => "compute_75".into(),
    }
}

/// Whether a GPU of compute capability `cc` may launch the tensor-core kernels. Below sm_80
/// kernels.cu compiles them to empty bodies (`__CUDA_ARCH__ < 800`), so launching one there
/// would return unwritten outputs: this must agree with [`arch_for`].
pub fn has_tensor_core_kernels(cc: Option<(i32, i32)>) -> bool {
    cc.is_some_and(|(major, _)| major >= 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `__CUDA_ARCH__` value kernels.cu sees for an NVRTC target (`compute_75` -> 750).
    fn cuda_arch(target: &str) -> u32 {
        let digits = target
            .strip_prefix("compute_")
            .expect("a compute_NN target");
        digits.parse::<u32>().expect("numeric architecture") * 10
    }

    #[test]
    fn targets_by_compute_capability() {
        for (cc, want) in [
            ((12, 0), "compute_80"), // Blackwell consumer
            ((10, 0), "compute_80"), // B200
            ((9, 0), "compute_80"),  // H100, H200
            ((8, 9), "compute_80"),  // L4, RTX 4090
            ((8, 6), "compute_80"),  // A10, RTX 3090
            ((8, 0), "compute_80"),  // A100
            ((7, 5), "compute_75"),  // T4
            ((7, 0), "compute_70"),  // V100
            ((6, 1), "compute_61"),  // P40, GTX 1080
            ((5, 2), "compute_52"),  // M40
        ] {
            assert_eq!(arch_for(Some(cc)), want, "compute capability {cc:?}");
        }
        assert_eq!(arch_for(None), "compute_75");
    }

    #[test]
    fn tensor_core_kernels_only_where_they_were_compiled_with_mma() {
        let caps = [
            None,
            Some((5, 2)),
            Some((6, 0)),
            Some((7, 5)),
            Some((8, 0)),
            Some((9, 0)),
        ];
        for cc in caps {
            let compiled_with_mma = cuda_arch(&arch_for(cc)) >= 800;
            assert_eq!(
                has_tensor_core_kernels(cc),
                compiled_with_mma,
                "compute capability {cc:?}"
            );
        }
    }
}
