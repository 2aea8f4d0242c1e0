//! Bearer-token access to the API, by scope: `commands` for `POST /v1/commands/...`; `admin`
//! for every admin endpoint, those that act (dead letters, timers, replay) and those that
//! read; `read` for the reading ones (`GET`) only, such as `/metrics` for a scraper. Health
//! and readiness stay open.
//!
//! No credentials, or unknown ones, get 401; a known token of the other scope gets 403. The
//! answer says nothing more. Tokens are compared as SHA-256 digests in constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error_response;
use crate::config::AuthConfig;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Commands,
    Admin,
    Read,
}

pub struct Tokens {
    enabled: bool,
    commands: Vec<[u8; 32]>,
    admin: Vec<[u8; 32]>,
    read: Vec<[u8; 32]>,
}

impl Tokens {
    pub fn new(config: &AuthConfig) -> Arc<Tokens> {
        let digest = |t: &crate::config::Secret| -> [u8; 32] { Sha256::digest(t.expose().as_bytes()).into() };
        Arc::new(Tokens {
            enabled: config.enabled(),
            commands: config.command_tokens.iter().map(digest).collect(),
            admin: config.admin_tokens.iter().map(digest).collect(),
            read: config.read_tokens.iter().map(digest).collect(),
        })
    }

    /// The scope of a presented token, if it is one of ours.
    fn scope_of(&self, token: &str) -> Option<Scope> {
        let presented: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let matches = |set: &[[u8; 32]]| {
            set.iter()
                .fold(false, |found, t| found | bool::from(t.ct_eq(&presented)))
        };
        if matches(&self.commands) {
            Some(Scope::Commands)
        } else if matches(&self.admin) {
            Some(Scope::Admin)
        } else if matches(&self.read) {
            Some(Scope::Read)
        } else {
            None
        }
    }
}

pub async fn commands(State(tokens): State<Arc<Tokens>>, request: Request, next: Next) -> Response {
    check(&tokens, &[Scope::Commands], request, next).await
}

/// The admin endpoints that act.
pub async fn admin(State(tokens): State<Arc<Tokens>>, request: Request, next: Next) -> Response {
    check(&tokens, &[Scope::Admin], request, next).await
}

/// The admin endpoints that only read.
pub async fn read(State(tokens): State<Arc<Tokens>>, request: Request, next: Next) -> Response {
    check(&tokens, &[Scope::Admin, Scope::Read], request, next).await
}

async fn check(tokens: &Tokens, allowed: &[Scope], request: Request, next: Next) -> Response {
    if !tokens.enabled {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    match presented.and_then(|t| tokens.scope_of(t)) {
        Some(scope) if allowed.contains(&scope) => next.run(request).await,
        Some(_) => error_response(StatusCode::FORBIDDEN, "forbidden", "not allowed"),
        None => {
            let mut response = error_response(StatusCode::UNAUTHORIZED, "unauthorized", "authentication required");
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}
