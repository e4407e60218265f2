//! Human-friendly sizes ("64GiB", "512MiB", "1.5GB") and durations ("1h",
//! "30s") for configuration and command-line flags, with serde support.
//!
//! Sizes accept a decimal number and an optional unit, case-insensitive and
//! with optional spaces: `B`, `KB` (10^3), `KiB` (2^10), `MB`, `MiB`, `GB`,
//! `GiB`, `TB`, `TiB`; a bare `K`, `M`, `G` or `T` is refused as ambiguous.
//! A bare integer is bytes. Durations use
//! humantime's syntax (`30s`, `5min`, `1h 30m`, `250ms`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A size in bytes, parsed from and printed as a human-friendly string.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

/// Why a size or a duration failed to parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a valid {what}: {reason} (examples: {examples})")]
pub struct ParseError {
    input: String,
    what: &'static str,
    reason: String,
    examples: &'static str,
}

const SIZE_EXAMPLES: &str = "\"64GiB\", \"512MiB\", \"1.5GB\", \"4096\"";
const DURATION_EXAMPLES: &str = "\"30s\", \"5min\", \"1h\", \"250ms\"";

/// Units, longest suffix first within each letter so "GiB" wins over "B".
const UNITS: &[(&str, u64)] = &[
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
    ("pib", 1 << 50),
    ("eib", 1 << 60),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("pb", 1_000_000_000_000_000),
    ("eb", 1_000_000_000_000_000_000),
    ("b", 1),
];

impl ByteSize {
    /// `n` KiB.
    pub const fn kib(n: u64) -> Self {
        Self(n << 10)
    }
    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        Self(n << 20)
    }
    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        Self(n << 30)
    }
    /// The number of bytes.
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

/// The reason given for a value that is another flag.
const FLAG_FOR_VALUE: &str =
    "this is a flag, not a value: the option before it needs its value first";

impl FromStr for ByteSize {
    type Err = ParseError;

    fn from_str(input: &str) -> Result<Self, ParseError> {
        let err = |reason: &str| ParseError {
            input: input.chars().take(80).collect(),
            what: "size",
            reason: reason.to_string(),
            examples: SIZE_EXAMPLES,
        };
        let s = input.trim().to_ascii_lowercase();
        if s.is_empty() {
            return Err(err("empty"));
        }
        match s.as_bytes()[0] {
            // A flag where the value should be (`--ram-budget --disk-budget
            // 1GiB`: flags take values that start with `-`, for the error
            // below).
            b'-' if s.starts_with("--") => return Err(err(FLAG_FOR_VALUE)),
            b'-' => return Err(err("a size cannot be negative")),
            b'+' => return Err(err("write the number without a sign")),
            _ => {}
        }
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let unit = unit.trim();
        let mult = if unit.is_empty() {
            1
        } else if let [letter @ (b'k' | b'm' | b'g' | b't' | b'p' | b'e')] = unit.as_bytes() {
            // systemd and the JVM read "8G" as GiB, SI as GB: a 7 % gap
            // either way, so the unit must say which.
            let l = (*letter as char).to_ascii_uppercase();
            return Err(err(&format!(
                "the unit \"{l}\" is ambiguous: write \"{l}iB\" (powers of 1024) or \"{l}B\" \
                 (powers of 1000)"
            )));
        } else {
            UNITS
                .iter()
                .find(|(u, _)| *u == unit)
                .map(|(_, m)| *m)
                .ok_or_else(|| {
                    // ASCII lowercasing keeps byte offsets: show the unit as written.
                    let written = input.trim().get(split..).unwrap_or(unit).trim();
                    err(&format!("unknown unit {written:?}"))
                })?
        };
        if num.is_empty() {
            return Err(err("no number"));
        }
        if num.bytes().all(|c| c.is_ascii_digit()) {
            return num
                .parse::<u64>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .map(ByteSize)
                .ok_or_else(|| err("too large"));
        }
        // Fractional: exact for anything a human writes ("1.5GiB"); reject
        // what does not fit or is not a plain decimal.
        let (int, frac) = num.split_once('.').ok_or_else(|| err("not a number"))?;
        if frac.contains('.') {
            return Err(err("not a number"));
        }
        if frac.is_empty() {
            return Err(err("no digit after the decimal point"));
        }
        if frac.len() > 9 {
            return Err(err("at most 9 digits after the decimal point"));
        }
        let int: u64 = if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| err("not a number"))?
        };
        let frac_val: u64 = frac.parse().map_err(|_| err("not a number"))?;
        if mult == 1 && frac_val != 0 {
            return Err(err("a number of bytes has no fraction"));
        }
        let scale = 10u64.pow(frac.len() as u32);
        let whole = int.checked_mul(mult).ok_or_else(|| err("too large"))?;
        let part = (u128::from(frac_val) * u128::from(mult)) / u128::from(scale);
        whole
            .checked_add(u64::try_from(part).map_err(|_| err("too large"))?)
            .map(ByteSize)
            .ok_or_else(|| err("too large"))
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that divides the size exactly ("4GiB",
    /// "1536MiB", "100B"), so printing and parsing round-trip.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, mult) in [
            ("TiB", 1u64 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ] {
            if self.0 >= mult && self.0 % mult == 0 {
                return write!(f, "{}{unit}", self.0 / mult);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl ByteSize {
    /// A short approximate rendering for humans ("3.7 GiB"); not parseable
    /// back exactly. Use `Display` for exact output.
    pub fn approx(self) -> String {
        self.rounded(f64::round)
    }

    /// [`approx`](Self::approx) rounded down, for a limit: 33,533,824 bytes
    /// is "31.9 MiB", never "32.0 MiB" (a 32 MiB chunk does not fit).
    pub fn approx_floor(self) -> String {
        self.rounded(f64::floor)
    }

    fn rounded(self, round: fn(f64) -> f64) -> String {
        let b = self.0 as f64;
        for (unit, mult) in [
            ("TiB", 1u64 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ] {
            if self.0 >= mult {
                return format!("{:.1} {unit}", round(b / mult as f64 * 10.0) / 10.0);
            }
        }
        format!("{} B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a size such as {SIZE_EXAMPLES}")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration, parsed from and printed in humantime syntax ("30s", "1h").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// `n` seconds.
    pub const fn secs(n: u64) -> Self {
        Self(Duration::from_secs(n))
    }
}

impl From<HumanDuration> for Duration {
    fn from(d: HumanDuration) -> Self {
        d.0
    }
}

impl FromStr for HumanDuration {
    type Err = ParseError;

    fn from_str(input: &str) -> Result<Self, ParseError> {
        let err = |reason: String| ParseError {
            input: input.chars().take(80).collect(),
            what: "duration",
            reason,
            examples: DURATION_EXAMPLES,
        };
        let t = input.trim();
        if t.starts_with("--") {
            return Err(err(FLAG_FOR_VALUE.into()));
        }
        // humantime says "expected number at 0" for "-5s".
        if t.starts_with('-') {
            return Err(err("a duration cannot be negative".into()));
        }
        humantime::parse_duration(t)
            .map(HumanDuration)
            .map_err(|e| err(e.to_string()))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_zero() {
            return f.write_str("0s");
        }
        write!(f, "{}", humantime::format_duration(self.0)).map(|_| ())
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a duration with a unit such as {DURATION_EXAMPLES}")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<HumanDuration, E> {
                if v == 0 {
                    return Ok(HumanDuration(Duration::ZERO));
                }
                Err(E::custom(format!(
                    "{v} has no unit; write a duration such as \"{v}s\" or \"{v}ms\""
                )))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<HumanDuration, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!("a duration cannot be negative ({v})"))),
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        let cases = [
            ("64GiB", 64u64 << 30),
            ("512MiB", 512 << 20),
            ("1.5GB", 1_500_000_000),
            ("1.5GiB", 3 << 29),
            ("4096", 4096),
            ("16 gib", 16 << 30),
            ("2kb", 2000),
            ("0", 0),
            ("0.5KiB", 512),
            ("10B", 10),
        ];
        for (s, want) in cases {
            assert_eq!(s.parse::<ByteSize>().unwrap(), ByteSize(want), "{s}");
        }
    }

    #[test]
    fn approximations_round_and_limits_round_down() {
        assert_eq!(ByteSize(33_533_824).approx(), "32.0 MiB");
        assert_eq!(ByteSize(33_533_824).approx_floor(), "31.9 MiB");
        assert_eq!(ByteSize(32 << 20).approx_floor(), "32.0 MiB");
        assert_eq!(ByteSize(1536).approx(), "1.5 KiB");
        assert_eq!(ByteSize(1000).approx_floor(), "1000 B");
    }

    #[test]
    fn bad_sizes_are_rejected_with_a_reason() {
        for s in [
            "",
            "GiB",
            "12XB",
            "-1",
            "1.2.3GB",
            "1.GB",
            "99999999999999999999",
            "20000000TiB",
            "1e9",
        ] {
            let e = s.parse::<ByteSize>().unwrap_err().to_string();
            assert!(e.contains("not a valid size"), "{s}: {e}");
        }
        // The reason fits the mistake.
        for (s, why) in [
            ("-5GiB", "cannot be negative"),
            ("+5GiB", "without a sign"),
            ("99999999999999999999", "too large"),
            ("20000000TiB", "too large"),
            // Units past TiB exist, so a huge size says so (QA: "unknown
            // unit \"EiB\"").
            ("99999999EiB", "too large"),
            ("16EiB", "too large"),
            ("8P", "\"P\" is ambiguous"),
            ("1.5", "no fraction"),
            ("1.5B", "no fraction"),
            (
                "1.1234567890GiB",
                "at most 9 digits after the decimal point",
            ),
            ("5.GiB", "no digit after the decimal point"),
            ("12XB", "unknown unit \"XB\""),
            ("8G", "\"G\" is ambiguous: write \"GiB\""),
            ("8g", "\"G\" is ambiguous"),
            ("512M", "\"MiB\" (powers of 1024) or \"MB\""),
            ("2 k", "\"K\" is ambiguous"),
            ("1.5T", "\"T\" is ambiguous"),
        ] {
            let e = s.parse::<ByteSize>().unwrap_err().to_string();
            assert!(e.contains(why), "{s}: {e}");
        }
        assert_eq!("1.0".parse::<ByteSize>().unwrap(), ByteSize(1));
        assert_eq!("2PiB".parse::<ByteSize>().unwrap(), ByteSize(2 << 50));
        assert_eq!("1EiB".parse::<ByteSize>().unwrap(), ByteSize(1 << 60));
        assert_eq!(
            "3PB".parse::<ByteSize>().unwrap(),
            ByteSize(3_000_000_000_000_000)
        );
    }

    #[test]
    fn sizes_display_round_trips() {
        for n in [
            0u64,
            1,
            1023,
            1024,
            3 << 29,
            64 << 30,
            (1 << 40) + 1,
            5 << 40,
        ] {
            let s = ByteSize(n).to_string();
            assert_eq!(s.parse::<ByteSize>().unwrap(), ByteSize(n), "{s}");
        }
        assert_eq!(ByteSize::gib(4).to_string(), "4GiB");
        assert_eq!(ByteSize(3 << 29).to_string(), "1536MiB");
    }

    #[test]
    fn durations_parse_and_round_trip() {
        assert_eq!(
            "1h".parse::<HumanDuration>().unwrap(),
            HumanDuration::secs(3600)
        );
        assert_eq!(
            "30s".parse::<HumanDuration>().unwrap(),
            HumanDuration::secs(30)
        );
        assert_eq!(
            "250ms".parse::<HumanDuration>().unwrap(),
            HumanDuration(Duration::from_millis(250))
        );
        for d in ["1h 30m", "250ms", "0s", "2days"] {
            let v: HumanDuration = d.parse().unwrap();
            assert_eq!(v.to_string().parse::<HumanDuration>().unwrap(), v, "{d}");
        }
        assert!("30".parse::<HumanDuration>().is_err());
        assert!("soon".parse::<HumanDuration>().is_err());
    }

    #[derive(Deserialize, Serialize, Debug, PartialEq)]
    struct Both {
        s: ByteSize,
        d: HumanDuration,
    }

    #[test]
    fn serde_accepts_strings_and_integer_bytes() {
        let v: Both = toml::from_str("s = \"2GiB\"\nd = \"5min\"").unwrap();
        assert_eq!(
            v,
            Both {
                s: ByteSize::gib(2),
                d: HumanDuration::secs(300)
            }
        );
        let v: Both = toml::from_str("s = 1024\nd = \"1s\"").unwrap();
        assert_eq!(v.s, ByteSize(1024));
        let e = toml::from_str::<Both>("s = 1\nd = 30")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"30s\""), "{e}");
        let e = toml::from_str::<Both>("s = -5\nd = \"1s\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("negative"), "{e}");
        let back: Both = toml::from_str(&toml::to_string(&v).unwrap()).unwrap();
        assert_eq!(back, v);
    }
}
