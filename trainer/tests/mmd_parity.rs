//! KID and CMMD against their references on fixed features (`scripts/mmd_parity.py`:
//! torchmetrics 1.9.0's `poly_mmd`, and the formula of the CMMD paper's reference code).

use ft_trainer::score::{cmmd, kid, mmd2, Estimator, Features, Kernel};

fn features(rows: &serde_json::Value) -> anyhow::Result<Features> {
    let rows = rows
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("rows are not a list"))?;
    let d = rows
        .first()
        .and_then(|r| r.as_array())
        .map_or(0, |r| r.len());
    let data: Vec<f64> = rows
        .iter()
        .flat_map(|r| r.as_array().into_iter().flatten())
        .map(|v| v.as_f64().unwrap_or(f64::NAN))
        .collect();
    Ok(Features::new(data, d)?)
}

#[test]
fn kid_and_cmmd_match_their_references() -> anyhow::Result<()> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/mmd/mmd.json"
    );
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let cases = fixture["cases"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("{path}: no cases"))?;
    assert_eq!(cases.len(), 3);
    for c in cases {
        let name = c["name"].as_str().unwrap_or("?");
        let (x, y) = (features(&c["x"])?, features(&c["y"])?);
        let close = |got: f64, key: &str| -> anyhow::Result<()> {
            let want = c[key]
                .as_f64()
                .ok_or_else(|| anyhow::anyhow!("{name}: no {key}"))?;
            let err = (got - want).abs() / want.abs().max(1e-12);
            anyhow::ensure!(err < 1e-10, "{name}: {key} {got} against {want}");
            Ok(())
        };
        close(kid(&x, &y)?, "kid")?;
        close(cmmd(&x, &y)?, "cmmd")?;
        let rbf = mmd2(
            &x,
            &y,
            Kernel::Gaussian { sigma: 10.0 },
            Estimator::Unbiased,
        )?;
        close(rbf, "rbf_unbiased")?;
    }
    Ok(())
}
