//! TLS for the pool's connections: libpq's `sslmode`, spoken with rustls.
//!
//! | `sslmode`     | encrypted                        | server certificate checked           |
//! | ------------- | -------------------------------- | ------------------------------------ |
//! | `disable`     | never                            | –                                    |
//! | `prefer`      | when the server offers it (default) | no                                |
//! | `require`     | always, or the connection fails  | no                                   |
//! | `verify-ca`   | always                           | chain, up to the CA file             |
//! | `verify-full` | always                           | chain, and the host name it was for  |
//!
//! tokio-postgres only knows the first three modes and refuses every key it
//! does not know, `sslrootcert` included, so [`split_url`] takes `sslmode`
//! and `sslrootcert` out of a URL (or `key=value` string) before it is
//! parsed: tokio-postgres is told `require` for the verifying modes, and the
//! connector built here decides what is checked. The CA file is read once,
//! when the configuration is checked, so a missing or unreadable file stops
//! the application from starting instead of failing every connection.
//!
//! As in libpq, TLS is never used over a Unix socket (the server refuses it
//! there), and `require` does not check the certificate: it guards against
//! eavesdropping, not against a server that impersonates the database.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::Config;
use crate::error::{Error, Result};

/// How a connection uses TLS, as libpq's `sslmode` says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP, even when the server offers TLS.
    Disable,
    /// TLS when the server offers it, unverified; plain otherwise. libpq's
    /// default, and this library's.
    Prefer,
    /// TLS or no connection; the certificate is not checked.
    Require,
    /// TLS, and the server's certificate must chain up to the CA file; the
    /// host name it names is not compared.
    VerifyCa,
    /// As `VerifyCa`, and the certificate must be for the host connected to
    /// (a DNS name or an IP address in its subjectAltName).
    VerifyFull,
}

const MODES: &str = "disable, prefer, require, verify-ca or verify-full";

impl SslMode {
    /// Parses libpq's spelling (`verify-full`); `None` for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// libpq's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// What tokio-postgres is told: whether to ask for TLS and whether to
    /// give up without it. The verification is the connector's business.
    pub(crate) fn wire(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as Wire;
        match self {
            SslMode::Disable => Wire::Disable,
            SslMode::Prefer => Wire::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Wire::Require,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Checks an `sslmode` setting named `setting` (`sslmode`, or `url` when it
/// came from the URL).
pub(crate) fn parse_mode(setting: &'static str, value: &str) -> Result<SslMode> {
    SslMode::parse(value).ok_or_else(|| {
        let reason = match setting {
            "sslmode" => format!("must be {MODES}"),
            _ => format!("sslmode must be {MODES}"),
        };
        Error::config(setting, reason)
    })
}

/// The TLS parameters taken out of a URL by [`split_url`], still unchecked.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct UrlTls {
    /// `sslmode=…`, decoded.
    pub sslmode: Option<String>,
    /// `sslrootcert=…`, decoded: the CA file.
    pub sslrootcert: Option<String>,
}

/// Takes `sslmode` and `sslrootcert` out of a libpq URL or `key=value`
/// string, and returns the rest for tokio-postgres to parse.
///
/// Parameters are found the way tokio-postgres finds them, so the rest parses
/// exactly as the whole would have. A string this cannot take apart is
/// returned whole: tokio-postgres then reports what is wrong with it.
pub(crate) fn split_url(url: &str) -> (Cow<'_, str>, UrlTls) {
    match ["postgres://", "postgresql://"]
        .iter()
        .find(|prefix| url.starts_with(**prefix))
    {
        Some(prefix) => split_query(url, prefix.len()),
        None => split_key_value(url).unwrap_or((Cow::Borrowed(url), UrlTls::default())),
    }
}

/// The URL form: `postgres://[user[:pw]@]host[:port][,…][/db][?k=v&…]`.
fn split_query(url: &str, prefix: usize) -> (Cow<'_, str>, UrlTls) {
    let mut tls = UrlTls::default();
    // tokio-postgres takes the credentials up to the first `@` (a password
    // may hold a `?`), then the query from the first `?` after them.
    let after = &url[prefix..];
    let authority = after.find('@').map_or(0, |at| at + 1);
    let Some(question) = after[authority..].find('?') else {
        return (Cow::Borrowed(url), tls);
    };
    let query_start = prefix + authority + question + 1;
    let mut kept: Vec<&str> = Vec::new();
    for pair in url[query_start..].split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match percent_decode(key).as_deref() {
            Some("sslmode") => tls.sslmode = percent_decode(value),
            Some("sslrootcert") => tls.sslrootcert = percent_decode(value),
            _ => kept.push(pair),
        }
    }
    if tls == UrlTls::default() {
        return (Cow::Borrowed(url), tls);
    }
    let mut rest = url[..query_start - 1].to_owned();
    if !kept.is_empty() {
        rest.push('?');
        rest.push_str(&kept.join("&"));
    }
    (Cow::Owned(rest), tls)
}

/// The `key=value …` form, values optionally single-quoted, `\` escaping.
/// `None` when it does not tokenize (tokio-postgres will say why).
fn split_key_value(s: &str) -> Option<(Cow<'_, str>, UrlTls)> {
    let mut tls = UrlTls::default();
    let mut kept: Vec<&str> = Vec::new();
    let bytes = s.as_bytes();
    let mut i = 0;
    let skip_ws = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_ws(i);
        if i == bytes.len() {
            break;
        }
        let start = i;
        while i < bytes.len() && !bytes[i].is_ascii_whitespace() && bytes[i] != b'=' {
            i += 1;
        }
        let key = &s[start..i];
        i = skip_ws(i);
        if bytes.get(i) != Some(&b'=') {
            return None;
        }
        i = skip_ws(i + 1);
        let mut value = Vec::new();
        if bytes.get(i) == Some(&b'\'') {
            i += 1;
            loop {
                match bytes.get(i) {
                    None => return None,
                    Some(b'\'') => break,
                    Some(b'\\') if i + 1 < bytes.len() => {
                        value.push(bytes[i + 1]);
                        i += 2;
                    }
                    Some(&b) => {
                        value.push(b);
                        i += 1;
                    }
                }
            }
            i += 1;
        } else {
            while i < bytes.len() && !bytes[i].is_ascii_whitespace() {
                if bytes[i] == b'\\' && i + 1 < bytes.len() {
                    i += 1;
                }
                value.push(bytes[i]);
                i += 1;
            }
        }
        let value = String::from_utf8(value).ok()?;
        match key {
            "sslmode" => tls.sslmode = Some(value),
            "sslrootcert" => tls.sslrootcert = Some(value),
            _ => kept.push(&s[start..i]),
        }
    }
    if tls == UrlTls::default() {
        return Some((Cow::Borrowed(s), tls));
    }
    Some((Cow::Owned(kept.join(" ")), tls))
}

/// `%XX` decoding of a URL component; `None` when the result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let (h, l) = (hex(h).unwrap_or(0), hex(l).unwrap_or(0));
                out.push(u8::try_from(h * 16 + l).unwrap_or(0));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The checked TLS settings of a [`Config`]: the mode and a connector that
/// verifies what the mode asks for.
#[derive(Clone)]
pub(crate) struct Tls {
    pub(crate) mode: SslMode,
    /// Whether a CA file was given (shown by `Config`'s Debug).
    pub(crate) has_ca_file: bool,
    connector: MakeRustlsConnect,
}

impl Tls {
    /// Builds the connector for `mode`, reading `ca_file` (PEM) when given.
    /// The verifying modes need one: there is no implicit system store, so
    /// what is trusted is always what the configuration names.
    pub(crate) fn new(mode: SslMode, ca_file: Option<&str>) -> Result<Self> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = ca_file.map(load_roots).transpose()?;
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::config("sslmode", e.to_string()))?;
        let client = match (mode, roots) {
            (SslMode::VerifyFull, Some(roots)) => {
                builder.with_root_certificates(roots).with_no_client_auth()
            }
            (SslMode::VerifyCa, Some(roots)) => {
                let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| Error::config("ssl_ca_file", e.to_string()))?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
                    .with_no_client_auth()
            }
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
                return Err(Error::config(
                    "ssl_ca_file",
                    format!(
                        "required by sslmode {mode}: a PEM file of the CA certificates to trust \
                         (ssl_ca_file, or sslrootcert in the url)"
                    ),
                ))
            }
            (SslMode::Disable | SslMode::Prefer | SslMode::Require, _) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
                .with_no_client_auth(),
        };
        Ok(Tls {
            mode,
            has_ca_file: ca_file.is_some(),
            connector: MakeRustlsConnect::new(client),
        })
    }
}

/// The connector the pool opens its connections with.
pub(crate) fn connector(config: &Config) -> MakeRustlsConnect {
    config.tls.connector.clone()
}

/// Every certificate of a PEM file, as trust anchors.
fn load_roots(path: &str) -> Result<RootCertStore> {
    let bad = |reason: String| Error::config("ssl_ca_file", reason);
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(format!("cannot be read: {}", pem_cause(&e))))?;
    let mut roots = RootCertStore::empty();
    for cert in certs {
        let cert = cert.map_err(|e| bad(format!("is not PEM: {}", pem_cause(&e))))?;
        roots
            .add(cert)
            .map_err(|e| bad(format!("holds a certificate that cannot be used: {e}")))?;
    }
    if roots.is_empty() {
        return Err(bad("holds no PEM certificate".into()));
    }
    Ok(roots)
}

fn pem_cause(err: &rustls::pki_types::pem::Error) -> String {
    match err {
        rustls::pki_types::pem::Error::Io(io) => io.to_string(),
        other => other.to_string(),
    }
}

/// `prefer` and `require`: any certificate is accepted, but the handshake's
/// signatures are still checked, so the session is what the certificate's
/// key signed (TLS without authentication, as libpq does it).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted CA; only a certificate that
/// fails on its name alone is let through. webpki checks the chain before
/// the name, so a name error means the chain was good.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(url: &str) -> (String, UrlTls) {
        let (rest, tls) = split_url(url);
        (rest.into_owned(), tls)
    }

    fn tls(mode: Option<&str>, root: Option<&str>) -> UrlTls {
        UrlTls {
            sslmode: mode.map(str::to_owned),
            sslrootcert: root.map(str::to_owned),
        }
    }

    #[test]
    fn every_libpq_mode_parses_and_nothing_else_does() {
        for mode in ["disable", "prefer", "require", "verify-ca", "verify-full"] {
            assert_eq!(SslMode::parse(mode).map(SslMode::as_str), Some(mode));
        }
        for bad in ["", "allow", "VERIFY-FULL", "verify_full", "true"] {
            assert_eq!(SslMode::parse(bad), None, "{bad}");
        }
        assert_eq!(
            parse_mode("sslmode", "allow").err().map(|e| e.to_string()).as_deref(),
            Some("invalid configuration: sslmode: must be disable, prefer, require, verify-ca or verify-full")
        );
    }

    #[test]
    fn the_verifying_modes_ask_tokio_postgres_for_require() {
        use tokio_postgres::config::SslMode as Wire;
        assert_eq!(SslMode::Disable.wire(), Wire::Disable);
        assert_eq!(SslMode::Prefer.wire(), Wire::Prefer);
        for mode in [SslMode::Require, SslMode::VerifyCa, SslMode::VerifyFull] {
            assert_eq!(mode.wire(), Wire::Require);
        }
    }

    #[test]
    fn tls_parameters_are_taken_out_of_a_url_and_the_rest_is_kept() {
        assert_eq!(
            split("postgres://u:p@h:5432/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x"),
            (
                "postgres://u:p@h:5432/db?application_name=x".to_owned(),
                tls(Some("verify-full"), Some("/etc/ca.pem"))
            )
        );
        assert_eq!(
            split("postgresql://h/db?sslmode=require"),
            ("postgresql://h/db".to_owned(), tls(Some("require"), None))
        );
        // A `?` in the password is part of the credentials, as for tokio-postgres.
        assert_eq!(
            split("postgres://u:a?b@h/db?connect_timeout=3&sslrootcert=ca.pem"),
            (
                "postgres://u:a?b@h/db?connect_timeout=3".to_owned(),
                tls(None, Some("ca.pem"))
            )
        );
        let plain = "postgres://u:p@h/db?application_name=x";
        assert!(matches!(split_url(plain), (Cow::Borrowed(s), _) if s == plain));
    }

    #[test]
    fn tls_parameters_are_taken_out_of_a_key_value_string() {
        assert_eq!(
            split(
                r"host=h  port = 5432 sslmode=verify-ca sslrootcert='/a dir/ca.pem' password='it\'s' dbname=x"
            ),
            (
                r"host=h port = 5432 password='it\'s' dbname=x".to_owned(),
                tls(Some("verify-ca"), Some("/a dir/ca.pem"))
            )
        );
        assert_eq!(
            split(r"sslrootcert=/a\ b.pem user=u"),
            ("user=u".to_owned(), tls(None, Some("/a b.pem")))
        );
        // Unterminated quote: left whole for tokio-postgres to report.
        assert_eq!(
            split("host=h sslmode='require"),
            ("host=h sslmode='require".to_owned(), tls(None, None))
        );
    }

    #[test]
    fn a_verifying_mode_without_a_ca_file_is_refused() {
        for mode in [SslMode::VerifyCa, SslMode::VerifyFull] {
            let err = Tls::new(mode, None).err().map(|e| e.to_string());
            assert_eq!(
                err,
                Some(format!(
                    "invalid configuration: ssl_ca_file: required by sslmode {mode}: a PEM file of \
                     the CA certificates to trust (ssl_ca_file, or sslrootcert in the url)"
                ))
            );
        }
        assert!(Tls::new(SslMode::Require, None).is_ok());
    }

    #[test]
    fn a_ca_file_that_is_missing_or_holds_no_certificate_is_refused() {
        let missing = Tls::new(SslMode::VerifyFull, Some("/nonexistent/ca.pem"))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            missing.as_deref(),
            Some("invalid configuration: ssl_ca_file: cannot be read: No such file or directory (os error 2)")
        );

        let empty = std::env::temp_dir().join(format!("locks-empty-ca-{}.pem", std::process::id()));
        std::fs::write(&empty, "not a certificate\n").expect("temp file");
        let err = Tls::new(SslMode::VerifyCa, empty.to_str())
            .err()
            .map(|e| e.to_string());
        let _ = std::fs::remove_file(&empty);
        assert_eq!(
            err.as_deref(),
            Some("invalid configuration: ssl_ca_file: holds no PEM certificate")
        );
    }
}
