//! TLS for the pool's connections: libpq's `sslmode` (see [`SslMode`]),
//! spoken with rustls on the `ring` provider.
//!
//! tokio-postgres knows whether to ask for TLS and whether to give up
//! without it ([`wire`]); what the certificate must prove is the business of
//! the connector built here ([`connector`]). The CA file is read once, when
//! the pool is built, so a missing or unreadable file stops the application
//! from starting instead of failing every connection.
//!
//! As in libpq, `require` does not check the certificate: it guards against
//! eavesdropping, not against a server that impersonates the database.

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

use crate::error::{Error, Result};
use crate::settings::SslMode;

/// What tokio-postgres is told: whether to ask for TLS and whether to give
/// up without it. The verifying modes are `require` to it.
pub(crate) fn wire(mode: SslMode) -> tokio_postgres::config::SslMode {
    use tokio_postgres::config::SslMode as Wire;
    match mode {
        SslMode::Disable => Wire::Disable,
        SslMode::Prefer => Wire::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Wire::Require,
    }
}

/// The connector for `mode`, trusting the certificates of `ca_file` (PEM).
/// The verifying modes need one: there is no implicit system store, so what
/// is trusted is always what the configuration names. With `disable` the
/// file is not read (the connector is never used).
pub(crate) fn connector(mode: SslMode, ca_file: Option<&str>) -> Result<MakeRustlsConnect> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let roots = ca_file.filter(|_| mode != SslMode::Disable).map(load_roots).transpose()?;
    let chain =
        match (mode, roots) {
            (SslMode::VerifyCa | SslMode::VerifyFull, Some(roots)) => Some(
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| Error::config("ssl_ca_file", e.to_string()))?,
            ),
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => return Err(Error::config(
                "ssl_ca_file",
                "required by the verifying sslmodes: a PEM file of the CA certificates to trust",
            )),
            (SslMode::Disable | SslMode::Prefer | SslMode::Require, _) => None,
        };
    let verifier =
        Verifier { provider: provider.clone(), chain, name: mode == SslMode::VerifyFull };
    let client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::config("sslmode", e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(client))
}

/// Every certificate of a PEM file, as trust anchors. Each error names the
/// file (quoted, as a setting's `got:` shows a value).
fn load_roots(path: &str) -> Result<RootCertStore> {
    let bad = |reason: String| Error::config("ssl_ca_file", reason);
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(format!("cannot read {path:?}: {}", pem_cause(&e))))?;
    let mut roots = RootCertStore::empty();
    for cert in certs {
        let cert = cert.map_err(|e| bad(format!("{path:?} is not PEM: {}", pem_cause(&e))))?;
        roots
            .add(cert)
            .map_err(|e| bad(format!("{path:?} holds a certificate that cannot be used: {e}")))?;
    }
    if roots.is_empty() {
        return Err(bad(format!("{path:?} holds no PEM certificate")));
    }
    Ok(roots)
}

fn pem_cause(err: &rustls::pki_types::pem::Error) -> String {
    match err {
        rustls::pki_types::pem::Error::Io(io) => io.to_string(),
        other => other.to_string(),
    }
}

/// The certificate check of every mode; the handshake's signatures are
/// always checked, so the session is what the certificate's key signed:
///
/// * `prefer` and `require` (`chain: None`): any certificate (TLS without
///   authentication, as libpq does it);
/// * `verify-ca` (`chain: Some`, not `name`): the chain must lead to a
///   trusted CA; only a certificate that fails on its name alone is let
///   through. webpki checks the chain before the name, so a name error means
///   the chain was good;
/// * `verify-full` (`chain: Some`, `name`): webpki's verdict, chain and name.
#[derive(Debug)]
struct Verifier {
    provider: Arc<CryptoProvider>,
    chain: Option<Arc<WebPkiServerVerifier>>,
    name: bool,
}

// rustls' names, shortened so the trait's methods read on one line.
type Verdict<T> = std::result::Result<T, rustls::Error>;
type Cert<'a> = CertificateDer<'a>;
type Signed = DigitallySignedStruct;
type Signature = HandshakeSignatureValid;

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Verdict<ServerCertVerified> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(&self, m: &[u8], c: &Cert<'_>, d: &Signed) -> Verdict<Signature> {
        verify_tls12_signature(m, c, d, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(&self, m: &[u8], c: &Cert<'_>, d: &Signed) -> Verdict<Signature> {
        verify_tls13_signature(m, c, d, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(mode: SslMode, ca_file: Option<&str>) -> Option<String> {
        connector(mode, ca_file).err().map(|e| e.to_string())
    }

    #[test]
    fn a_ca_file_is_refused_when_it_holds_no_certificate_and_not_read_with_disable() {
        assert_eq!(refusal(SslMode::Disable, Some("/nonexistent/ca.pem")), None);
        let empty = std::env::temp_dir().join(format!("locks-empty-ca-{}.pem", std::process::id()));
        std::fs::write(&empty, "not a certificate\n").expect("temp file");
        let err = refusal(SslMode::VerifyCa, empty.to_str());
        let _ = std::fs::remove_file(&empty);
        let expected =
            format!("invalid configuration: ssl_ca_file: {empty:?} holds no PEM certificate");
        assert_eq!(err, Some(expected));
    }
}
