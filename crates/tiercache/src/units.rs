//! Parsing and printing byte sizes ("512k", "4KiB", "1G", "4096").
//!
//! Invariant: parsing never panics; overflow and unknown suffixes are errors.

/// Parses a size with an optional binary suffix (k, m, g, t; "iB"/"B" optional).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 4096, 512k, 10G)"))?;
    let mult: u64 = match suffix
        .to_ascii_lowercase()
        .trim_end_matches("ib")
        .trim_end_matches('b')
    {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        _ => {
            return Err(format!(
                "'{s}' has an unknown size suffix (use k, M, G or T)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// Formats bytes for people: "1.5 GiB".
pub fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert!(parse_size("12x").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(human(1536), "1.5 KiB");
    }
}
