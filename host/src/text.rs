//! Others' words in the host's messages: a plugin's or a peer's strings, whose length they
//! choose, quoted or kept only in part. An error that quoted a 100 MB name whole took five
//! times that as escaped text, and was logged, kept and served as long.

use std::borrow::Cow;
use std::fmt;

/// The characters of a value [`shown`] quotes.
const SHOWN_CHARS: usize = 64;

/// `value`, quoted (escaped as Rust's `{:?}` does), cut at 64 characters with its length said.
pub fn shown(value: &str) -> Shown<'_> {
    Shown(value)
}

/// See [`shown`].
pub struct Shown<'a>(&'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(SHOWN_CHARS) {
            Some((end, _)) => write!(f, "{:?}... ({} bytes)", &self.0[..end], self.0.len()),
            None => write!(f, "{:?}", self.0),
        }
    }
}

/// `text` cut at `max` bytes, on a character boundary, with its length said.
pub fn clipped(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    format!("{}... ({} bytes)", prefix(text, max), text.len()).into()
}

/// The longest start of `text` of at most `max` bytes that ends on a character's boundary.
pub fn prefix(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::{clipped, shown};

    #[test]
    fn long_words_are_cut_and_short_ones_kept() {
        assert_eq!(shown("a\"b").to_string(), r#""a\"b""#);
        let long = "\u{1}".repeat(1_000_000);
        let quoted = shown(&long).to_string();
        assert!(
            quoted.len() < 64 * 8 && quoted.ends_with("... (1000000 bytes)"),
            "{quoted}"
        );
        assert_eq!(clipped("short", 10), "short");
        assert_eq!(clipped("ééé", 3), "é... (6 bytes)");
    }
}
