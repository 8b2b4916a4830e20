//! TLS for the pool's connections: libpq's `sslmode` (see [`SslMode`]),
//! spoken with rustls on the `ring` provider.
//!
//! tokio-postgres knows whether to ask for TLS and whether to give up
//! without it ([`wire`]); what the certificate must prove, and what the
//! client proves with a certificate of its own, is the business of the
//! connector built here ([`connector`]). Every file and certificate is read
//! once, when the pool is built, so a missing or unreadable one stops the
//! application from starting instead of failing every connection.
//!
//! What to trust is always what the settings name: a PEM file
//! (`ssl_ca_file`), or DER certificates (`ssl_cacerts`: a repo's
//! `cacerts:`, or the OS store, which Elixir reads with
//! `:public_key.cacerts_get()`, exactly as Postgrex does).
//!
//! As in libpq, `require` does not check the certificate: it guards against
//! eavesdropping, not against a server that impersonates the database.

use std::io;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, RootCertStore, SignatureScheme};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::connect::Socket;
use crate::error::{Error, Result};
use crate::settings::{Der, KeyFormat, Settings, SslMode};

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

/// The connector for `mode` and the TLS settings of `settings`. The
/// verifying modes need CA certificates; with `disable` nothing is read,
/// neither a CA nor a client certificate (the connector is never used).
pub(crate) fn connector(mode: SslMode, settings: &Settings) -> Result<MakeTls> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifying = matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull);
    // CAs given are read in every mode that speaks TLS: one that cannot be
    // used stops the start, even where `require` would not use it.
    let given = settings.ssl_ca_file.is_some() || settings.ssl_cacerts.is_some();
    let roots = (mode != SslMode::Disable && (verifying || given)).then(|| roots(settings));
    let chain = match roots.transpose()? {
        Some(roots) if verifying => Some(
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| Error::config("ssl_ca_file", e.to_string()))?,
        ),
        _ => None,
    };
    let verifier =
        Verifier { provider: provider.clone(), chain, name: mode == SslMode::VerifyFull };
    let client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::config("sslmode", e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    let certificate = match mode {
        SslMode::Disable => None,
        _ => client_certificate(settings)?,
    };
    let client = match certificate {
        None => client.with_no_client_auth(),
        Some((chain, key)) => client.with_client_auth_cert(chain, key).map_err(|e| {
            Error::config("ssl_key_file", format!("does not go with the client certificate: {e}"))
        })?,
    };
    Ok(MakeTls { inner: MakeRustlsConnect::new(client), name: settings.ssl_server_name.clone() })
}

/// The trust anchors of the verifying modes: `ssl_cacerts` when given,
/// else the PEM file `ssl_ca_file`.
fn roots(settings: &Settings) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    match (&settings.ssl_cacerts, &settings.ssl_ca_file) {
        (Some(ders), _) => {
            for (Der(der), n) in ders.iter().zip(1..) {
                roots.add(CertificateDer::from(der.as_slice())).map_err(|e| {
                    Error::config("ssl_cacerts", format!("certificate {n} cannot be used: {e}"))
                })?;
            }
            if roots.is_empty() {
                return Err(Error::config("ssl_cacerts", "holds no certificate"));
            }
        }
        (None, Some(path)) => {
            for cert in pem_certificates(path, "ssl_ca_file")? {
                let reason = |e| format!("{path:?} holds a certificate that cannot be used: {e}");
                roots.add(cert).map_err(|e| Error::config("ssl_ca_file", reason(e)))?;
            }
        }
        (None, None) => {
            return Err(Error::config(
                "ssl_ca_file",
                "required by the verifying sslmodes: a PEM file of the CA certificates to trust \
                 (\"system\" for the OS store)",
            ))
        }
    }
    Ok(roots)
}

/// The client certificate's chain and key, when one is set: DER
/// (`ssl_cert`, `ssl_key`) or PEM files (`ssl_cert_file`, `ssl_key_file`).
fn client_certificate(
    settings: &Settings,
) -> Result<Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>> {
    let chain = match (&settings.ssl_cert, &settings.ssl_cert_file) {
        (Some(ders), _) => Some(ders.iter().map(|Der(der)| der.clone().into()).collect()),
        (None, Some(path)) => Some(pem_certificates(path, "ssl_cert_file")?),
        (None, None) => None,
    };
    let key = match (&settings.ssl_key, &settings.ssl_key_file) {
        (Some((format, Der(der))), _) => Some(match format {
            KeyFormat::Pkcs1 => PrivateKeyDer::Pkcs1(der.clone().into()),
            KeyFormat::Sec1 => PrivateKeyDer::Sec1(der.clone().into()),
            KeyFormat::Pkcs8 => PrivateKeyDer::Pkcs8(der.clone().into()),
        }),
        (None, Some(path)) => Some(PrivateKeyDer::from_pem_file(path).map_err(|e| {
            Error::config("ssl_key_file", format!("no private key in {path:?}: {}", pem_cause(&e)))
        })?),
        (None, None) => None,
    };
    match (chain, key) {
        (Some(chain), Some(key)) => Ok(Some((chain, key))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(Error::config("ssl_key_file", "required with ssl_cert_file")),
        (None, Some(_)) => Err(Error::config("ssl_cert_file", "required with ssl_key_file")),
    }
}

/// Every certificate of a PEM file, at least one. Each error names the file
/// (quoted, as a setting's `got:` shows a value) and the setting.
fn pem_certificates(path: &str, setting: &str) -> Result<Vec<CertificateDer<'static>>> {
    let bad = |reason: String| Error::config(setting, reason);
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(format!("cannot read {path:?}: {}", pem_cause(&e))))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("{path:?} is not PEM: {}", pem_cause(&e))))?;
    if certs.is_empty() {
        return Err(bad(format!("{path:?} holds no PEM certificate")));
    }
    Ok(certs)
}

/// The connector of a pool: rustls', naming the server `ssl_server_name`
/// when set (a repo's `server_name_indication:`: the name sent as SNI and the
/// one the certificate must carry), else the host connected to.
#[derive(Clone)]
pub(crate) struct MakeTls {
    inner: MakeRustlsConnect,
    name: Option<String>,
}

/// The TLS of one connection, to start once the server agrees to it.
pub(crate) type Tls = <MakeRustlsConnect as MakeTlsConnect<Socket>>::TlsConnect;

impl MakeTls {
    /// The TLS of a connection to `host`: rustls' (which cannot fail to make one).
    pub(crate) fn for_host(&self, host: &str) -> Tls {
        let name = self.name.as_deref().unwrap_or(host);
        let Ok(tls) = MakeTlsConnect::<Socket>::make_tls_connect(&mut self.inner.clone(), name);
        tls
    }
}

/// What a connect error `err` adds to its own text: for a certificate rustls
/// refused, how to trust it or, to keep what an older Postgrex did, not to
/// check it; else nothing.
pub(crate) fn hint(err: &tokio_postgres::Error) -> &'static str {
    let io = std::error::Error::source(err).and_then(|e| e.downcast_ref::<io::Error>());
    match io.and_then(io::Error::get_ref).and_then(|e| e.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidCertificate(_)) => HINT,
        _ => "",
    }
}

/// Appended to a refused certificate's error.
pub(crate) const HINT: &str = " (checked as Postgrex 0.18 and later check it: name its CA with \
    the repo's cacerts:/cacertfile: or ssl_ca_file; verify: :verify_none in the repo's ssl \
    options, or sslmode: :require, connects without checking it, as older Postgrex did)";

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
type Signed = rustls::DigitallySignedStruct;
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
        let Some(chain) = &self.chain else { return Ok(ServerCertVerified::assertion()) };
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
