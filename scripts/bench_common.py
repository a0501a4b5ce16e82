"""What the PyTorch sides of the bench commands share: a train step timed after a warm-up, and its
resident-set peak (Linux: VmHWM, reset through /proc/self/clear_refs) above the post-warm-up
level and above the level before the warm-up, the measures the Rust side reports as `rss_peak`
and `rss_from_start` (`ft_trainer::train::bench`)."""
import json
import time

import torch


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_and_print(step, steps, **extra):
    """[`measure`], printed as one JSON line with `extra`."""
    print(json.dumps({**measure(step, steps), **extra}))


def measure(step, steps):
    """Runs `step` once (warm-up: optimizer state exists from then on), then `steps` times, and
    returns the mean step time and the RSS peak above the post-warm-up level, and above the
    level before the warm-up (what the process keeps between steps and the warm-up's one-time
    costs counted; the Rust side's `rss_from_start`), and what the warm-up left resident. The
    scripts call it before any other step, as the Rust side's first measure in a process."""
    start = rss_kib("VmRSS")
    reset_ok = reset_hwm()
    step()
    warm_up_hwm = rss_kib("VmHWM")
    base = rss_kib("VmRSS")
    reset_ok = reset_ok and reset_hwm()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = (time.perf_counter() - t0) / steps
    peak = rss_kib("VmHWM")
    return {
        "step_time_s": dt,
        "rss_peak_above_base_bytes": (peak - base) * 1024 if reset_ok else None,
        "rss_peak_above_start_bytes": (max(peak, warm_up_hwm) - start) * 1024 if reset_ok else None,
        "rss_base_bytes": base * 1024,
        "rss_kept_by_warm_up_bytes": max(0, base - start) * 1024 if reset_ok else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
