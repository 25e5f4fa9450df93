//! The one budget rule: a budget is bytes, or a fraction in (0, 1] of plain PyTorch's peak.
//! `remat-plan`, the Python API and `python -m remat` all turn budgets into bytes here.

use crate::error::{Error, Result};

/// A memory budget as given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    Bytes(u64),
    /// Of plain PyTorch's peak, in (0, 1].
    Fraction(f64),
}

const UNITS: [(&str, u64); 8] = [
    ("", 1),
    ("b", 1),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
];

impl Budget {
    /// A fraction of plain PyTorch's peak; outside (0, 1] it is an [`Error::Argument`].
    pub fn fraction(f: f64) -> Result<Budget> {
        if f > 0.0 && f <= 1.0 {
            Ok(Budget::Fraction(f))
        } else {
            Err(Error::Argument(format!(
                "a fractional budget lies in (0, 1], got {f}; pass bytes as a whole number"
            )))
        }
    }

    /// `"300000"`, `"512MiB"`, `"2GiB"`, `"1.5GB"`: bytes; `"0.4"`: a fraction.
    pub fn parse(text: &str) -> Result<Budget> {
        let bad = || {
            Error::Argument(format!(
                "a budget is bytes (300000, 512MiB, 2GiB, 1.5GB) or a fraction in (0, 1], got {text:?}"
            ))
        };
        let text = text.trim();
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, unit) = (&text[..split], text[split..].trim().to_ascii_lowercase());
        let scale = UNITS
            .iter()
            .find(|(u, _)| *u == unit)
            .map(|&(_, s)| s)
            .ok_or_else(bad)?;
        if unit.is_empty() && number.contains('.') {
            return Budget::fraction(number.parse().map_err(|_| bad())?);
        }
        if let Ok(n) = number.parse::<u64>() {
            return n.checked_mul(scale).map(Budget::Bytes).ok_or_else(bad);
        }
        let x: f64 = number.parse().map_err(|_| bad())?;
        Ok(Budget::Bytes((x * scale as f64) as u64))
    }

    /// In bytes, for a graph whose plain PyTorch peak is `plain_peak`.
    pub fn bytes(self, plain_peak: u64) -> u64 {
        match self {
            Budget::Bytes(b) => b,
            Budget::Fraction(f) => (f * plain_peak as f64) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Budget;

    #[test]
    fn bytes_with_units_and_fractions() {
        let parsed = |t: &str| Budget::parse(t).unwrap();
        assert_eq!(parsed("300000"), Budget::Bytes(300_000));
        assert_eq!(parsed("512MiB"), Budget::Bytes(512 << 20));
        assert_eq!(parsed(" 2 GiB "), Budget::Bytes(2 << 30));
        assert_eq!(parsed("1.5GB"), Budget::Bytes(1_500_000_000));
        assert_eq!(parsed("0.4"), Budget::Fraction(0.4));
        assert_eq!(parsed("0.4").bytes(1000), 400);
        for bad in ["1.5", "lots", "2 parsecs", "-3", "", "0.0"] {
            assert!(Budget::parse(bad).is_err(), "{bad}");
        }
    }
}
