//! SCRAM-SHA-256 password verifiers (RFC 5802 and 7677), as Postgres stores them: the host
//! sets passwords with them, so that a password never travels or is logged in clear text.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The SCRAM-SHA-256 verifier of `password` (RFC 5802 and 7677), as Postgres stores it.
pub fn verifier(password: &str) -> String {
    const ITERATIONS: u32 = 4096;
    let salt = *uuid::Uuid::new_v4().as_bytes();
    let hmac = |key: &[u8], data: &[u8]| -> [u8; 32] {
        let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
        mac.update(data);
        mac.finalize().into_bytes().into()
    };
    // PBKDF2-HMAC-SHA-256 with one block: U1 = HMAC(P, salt || 1), Ui = HMAC(P, Ui-1).
    let mut block = salt.to_vec();
    block.extend_from_slice(&1u32.to_be_bytes());
    let mut u = hmac(password.as_bytes(), &block);
    let mut salted = u;
    for _ in 1..ITERATIONS {
        u = hmac(password.as_bytes(), &u);
        for (s, x) in salted.iter_mut().zip(u) {
            *s ^= x;
        }
    }
    let stored_key = Sha256::digest(hmac(&salted, b"Client Key"));
    let server_key = hmac(&salted, b"Server Key");
    let b64 = base64::engine::general_purpose::STANDARD;
    format!(
        "SCRAM-SHA-256${ITERATIONS}:{}${}:{}",
        b64.encode(salt),
        b64.encode(stored_key),
        b64.encode(server_key)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scram_verifier_has_postgres_shape() {
        let v = verifier("secret");
        let (head, keys) = v.split_once('$').unwrap().1.split_once('$').unwrap();
        assert!(head.starts_with("4096:"), "{v}");
        let (stored, server) = keys.split_once(':').unwrap();
        let b64 = base64::engine::general_purpose::STANDARD;
        assert_eq!(b64.decode(stored).unwrap().len(), 32);
        assert_eq!(b64.decode(server).unwrap().len(), 32);
        assert_ne!(verifier("secret"), v, "a fresh salt each time");
    }
}
