//! rustls configurations for the peer links: mutual TLS against the
//! cluster CA (ring provider, TLS 1.3 only, ALPN `kvtier/1`).
//!
//! Both verifiers wrap rustls' webpki verifiers (chain to the cluster CA,
//! validity window, signatures) and ALSO check that the certificate carries
//! our cluster id and a node name, and is not expired. Every refusal is
//! logged with its reason. The server-name check of the client side is done
//! against the node name in the presented certificate: seeds are addresses,
//! and the node name is learned from the certificate (and must match the
//! hello).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

use crate::Error;
use crate::cert::{CertIdentity, NodeMaterial, pem_certs, pem_key};

/// ALPN protocol id of the peer protocol.
pub const ALPN: &[u8] = b"kvtier/1";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Tls(format!("{what}: {e}"))
}

/// TLS configuration for one node: both directions, plus the identity
/// learned from the certificate files.
#[derive(Clone)]
pub struct TlsSetup {
    /// Config for accepting peers.
    pub server: Arc<rustls::ServerConfig>,
    /// Config for dialing peers.
    pub client: Arc<rustls::ClientConfig>,
    /// Our node name (from our certificate).
    pub node_name: String,
    /// Our cluster id (from the CA certificate).
    pub cluster: String,
    /// Whether this is the `--insecure-dev` setup (no CA).
    pub insecure: bool,
}

impl std::fmt::Debug for TlsSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSetup")
            .field("node_name", &self.node_name)
            .field("cluster", &self.cluster)
            .field("insecure", &self.insecure)
            .finish_non_exhaustive()
    }
}

/// `secs` since the Unix epoch as a UTC time, `2026-12-06T18:35:55Z` (QA:
/// a refusal named raw Unix seconds).
fn utc(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // The civil date of a day count (H. Hinnant's `civil_from_days`).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

/// A certificate past its `not_after` at `now` (Unix seconds).
fn expired(not_after: i64, now: i64) -> String {
    format!(
        "certificate expired at {} ({} s ago)",
        utc(not_after),
        now - not_after
    )
}

/// A certificate before its `not_before` at `now` (Unix seconds).
fn not_valid_yet(not_before: i64, now: i64) -> String {
    format!(
        "certificate not valid before {} (in {} s; are the clocks of the nodes apart?)",
        utc(not_before),
        not_before - now
    )
}

/// A certificate refusal of the TLS library, in an operator's words where
/// the library's are terse (QA: `BadSignature`, raw Unix seconds).
fn describe(e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    let secs = |t: &UnixTime| i64::try_from(t.as_secs()).unwrap_or(i64::MAX);
    match e {
        rustls::Error::InvalidCertificate(c) => match c {
            C::ExpiredContext { time, not_after } => expired(secs(not_after), secs(time)),
            C::NotValidYetContext { time, not_before } => {
                not_valid_yet(secs(not_before), secs(time))
            }
            C::BadSignature => "certificate was not signed by this cluster's CA (BadSignature: \
                 issued by another CA, perhaps one with the same cluster name; issue it from \
                 this cluster's ca.key)"
                .into(),
            C::UnknownIssuer => "certificate was issued by a CA this node does not trust \
                 (UnknownIssuer: another cluster's CA, or a missing intermediate)"
                .into(),
            _ => e.to_string(),
        },
        _ => e.to_string(),
    }
}

/// Checks the kvtier identity of a peer certificate; returns the node name.
fn check_identity(
    end_entity: &CertificateDer<'_>,
    cluster: &str,
    now: UnixTime,
) -> Result<String, String> {
    let id = CertIdentity::parse(end_entity).map_err(|e| e.to_string())?;
    let now = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
    if id.not_after < now {
        return Err(expired(id.not_after, now));
    }
    if id.not_before > now {
        return Err(not_valid_yet(id.not_before, now));
    }
    match id.cluster.as_deref() {
        Some(c) if c == cluster => {}
        Some(c) => {
            return Err(format!(
                "certificate is for cluster {c:?}, we are {cluster:?}"
            ));
        }
        None => return Err("certificate carries no kvtier://cluster/ URI".into()),
    }
    id.node
        .ok_or_else(|| "certificate carries no node name".into())
}

fn refused(side: &str, reason: &str) -> rustls::Error {
    // A peer with a wrong certificate retries for good: said once per
    // reason at warn (and again after a while), else at debug.
    if crate::logonce::warn_now(format!("cert|{side}|{}", crate::logonce::shape(reason))) {
        tracing::warn!(
            side,
            reason,
            "refused peer certificate (repeats are logged at debug)"
        );
    } else {
        tracing::debug!(side, reason, "refused peer certificate");
    }
    rustls::Error::General(format!("kvtier: refused peer certificate: {reason}"))
}

#[derive(Debug)]
struct ClusterServerVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    cluster: String,
}

impl ServerCertVerifier for ClusterServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let id = CertIdentity::parse(end_entity).map_err(|e| refused("client", &e.to_string()))?;
        let node = id
            .node
            .ok_or_else(|| refused("client", "certificate carries no node name"))?;
        let name = ServerName::try_from(node.clone()).map_err(|e| {
            refused(
                "client",
                &format!("node name {node:?} is not a DNS name: {e}"),
            )
        })?;
        self.inner
            .verify_server_cert(end_entity, intermediates, &name, ocsp, now)
            .map_err(|e| refused("client", &describe(&e)))?;
        check_identity(end_entity, &self.cluster, now).map_err(|r| refused("client", &r))?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[derive(Debug)]
struct ClusterClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    cluster: String,
}

impl ClientCertVerifier for ClusterClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)
            .map_err(|e| refused("server", &describe(&e)))?;
        check_identity(end_entity, &self.cluster, now).map_err(|r| refused("server", &r))?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }
}

/// Accepts any certificate (still checks handshake signatures): only for
/// `--insecure-dev`, which binds loopback only.
#[derive(Debug)]
struct InsecureVerifier(Arc<CryptoProvider>);

impl InsecureVerifier {
    fn sig12(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn sig13(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
}

impl ServerCertVerifier for InsecureVerifier {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.sig12(m, c, d)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.sig13(m, c, d)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

impl ClientCertVerifier for InsecureVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }
    fn verify_client_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.sig12(m, c, d)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.sig13(m, c, d)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn build(
    provider: Arc<CryptoProvider>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_verifier: Arc<dyn ClientCertVerifier>,
    server_verifier: Arc<dyn ServerCertVerifier>,
) -> Result<(rustls::ServerConfig, rustls::ClientConfig), Error> {
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err("server protocol versions", e))?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| match e {
            rustls::Error::InconsistentKeys(_) => tls_err(
                "server certificate",
                "node.key is not the key of node.pem (the two files come from different \
                 `kvtier cert issue` runs; keep the pair one run wrote)",
            ),
            e => tls_err("server certificate", e),
        })?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err("client protocol versions", e))?
        .dangerous()
        .with_custom_certificate_verifier(server_verifier)
        .with_client_auth_cert(chain, key)
        .map_err(|e| tls_err("client certificate", e))?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    Ok((server, client))
}

impl TlsSetup {
    /// Builds the mutual-TLS setup from a node's files (`ca.pem`,
    /// `node.pem`, `node.key`). Fails if our own certificate does not carry
    /// the CA's cluster id, a node name, or is expired.
    pub fn from_material(m: &NodeMaterial) -> Result<Self, Error> {
        Self::build_from(m, true)
    }

    /// Like [`TlsSetup::from_material`] but accepts our own certificate
    /// even when expired or foreign (to test that *peers* refuse it).
    #[cfg(feature = "test_utils")]
    pub fn from_material_unchecked(m: &NodeMaterial) -> Result<Self, Error> {
        Self::build_from(m, false)
    }

    /// Like [`TlsSetup::from_material`] with another rustls provider (e.g.
    /// one cipher suite only, to measure its cost).
    #[cfg(feature = "test_utils")]
    pub fn from_material_with_provider(
        m: &NodeMaterial,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, Error> {
        Self::build_with(m, true, provider)
    }

    fn build_from(m: &NodeMaterial, check_own: bool) -> Result<Self, Error> {
        Self::build_with(m, check_own, provider())
    }

    fn build_with(
        m: &NodeMaterial,
        check_own: bool,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, Error> {
        let ca = pem_certs(&m.ca_pem, "ca.pem")?;
        let chain = pem_certs(&m.cert_pem, "node.pem")?;
        let key = pem_key(&m.key_pem)?;
        let ca_id = CertIdentity::parse(&ca[0])?;
        let cluster = ca_id.cluster.ok_or_else(|| Error::Cert {
            what: "ca.pem".into(),
            detail: "CA certificate carries no kvtier://cluster/ URI".into(),
        })?;
        let node_name = match check_identity(&chain[0], &cluster, UnixTime::now()) {
            Ok(n) => n,
            Err(why) if check_own => {
                return Err(Error::Cert {
                    what: "node.pem".into(),
                    detail: why,
                });
            }
            Err(_) => CertIdentity::parse(&chain[0])?.node.unwrap_or_default(),
        };
        let mut roots = RootCertStore::empty();
        for c in ca {
            roots
                .add(c)
                .map_err(|e| tls_err("add CA to root store", e))?;
        }
        let roots = Arc::new(roots);
        let client_inner = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| tls_err("client verifier", e))?;
        if check_own {
            // A node certificate its own ca.pem does not sign would be
            // refused by every peer; say so at start, not at each dial.
            client_inner
                .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
                .map_err(|e| Error::Cert {
                    what: "node.pem".into(),
                    detail: format!(
                        "not signed by the CA in ca.pem ({e}): every peer would refuse it; \
                         issue it again with `kvtier cert issue --ca` that CA's directory"
                    ),
                })?;
        }
        let server_inner =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| tls_err("server verifier", e))?;
        let (server, client) = build(
            provider,
            chain,
            key,
            Arc::new(ClusterClientVerifier {
                inner: client_inner,
                cluster: cluster.clone(),
            }),
            Arc::new(ClusterServerVerifier {
                inner: server_inner,
                cluster: cluster.clone(),
            }),
        )?;
        Ok(Self {
            server: Arc::new(server),
            client: Arc::new(client),
            node_name,
            cluster,
            insecure: false,
        })
    }

    /// The `--insecure-dev` setup: a fresh self-signed certificate, and
    /// verifiers that accept any peer certificate. The transport refuses to
    /// use it on anything but loopback addresses.
    pub fn insecure_dev(node_name: &str) -> Result<Self, Error> {
        crate::cert::validate_name("node", node_name)?;
        let provider = provider();
        let cert_err = |e: rcgen::Error| Error::Cert {
            what: "self-signed certificate".into(),
            detail: e.to_string(),
        };
        // The node's name as its common name: a peer counts what it serves
        // under the name a certificate carries (rcgen's default CN would
        // name every insecure node "rcgen self signed cert").
        let mut params =
            rcgen::CertificateParams::new(vec![node_name.to_owned()]).map_err(cert_err)?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, node_name);
        let key_pair = rcgen::KeyPair::generate().map_err(cert_err)?;
        let cert = params.self_signed(&key_pair).map_err(cert_err)?;
        let chain = vec![cert.der().clone()];
        let key = PrivateKeyDer::Pkcs8(key_pair.serialize_der().into());
        let v = Arc::new(InsecureVerifier(provider.clone()));
        let (server, client) = build(provider, chain, key, v.clone(), v)?;
        Ok(Self {
            server: Arc::new(server),
            client: Arc::new(client),
            node_name: node_name.to_owned(),
            cluster: "insecure-dev".into(),
            insecure: true,
        })
    }
}

/// The node name in a peer's certificate chain as quinn hands it over.
pub fn peer_node_name(chain: &[CertificateDer<'static>]) -> Option<String> {
    let id = CertIdentity::parse(chain.first()?).ok()?;
    id.node
}

#[cfg(test)]
mod tests {
    #[test]
    fn refusals_are_described_in_plain_words() {
        use rustls::CertificateError as C;
        use rustls::pki_types::UnixTime;
        let t = |s| UnixTime::since_unix_epoch(std::time::Duration::from_secs(s));
        let e = rustls::Error::InvalidCertificate(C::ExpiredContext {
            time: t(1_796_583_081),
            not_after: t(1_796_583_062),
        });
        assert_eq!(
            super::describe(&e),
            "certificate expired at 2026-12-06T18:51:02Z (19 s ago)"
        );
        let e = rustls::Error::InvalidCertificate(C::BadSignature);
        assert!(super::describe(&e).contains("not signed by this cluster's CA"));
    }

    #[test]
    fn a_key_of_another_certificate_is_named_so() {
        use crate::cert::{Validity, init_ca, issue};
        let ca = init_ca("prod", Validity::days(1)).expect("ca");
        let a = issue(&ca, "a", &[], &[], Validity::days(1)).expect("a");
        let b = issue(&ca, "b", &[], &[], Validity::days(1)).expect("b");
        let mixed = crate::cert::NodeMaterial {
            ca_pem: a.ca_pem,
            cert_pem: a.cert_pem,
            key_pem: b.key_pem,
        };
        let e = super::TlsSetup::from_material(&mixed).expect_err("mismatched key");
        assert!(
            e.to_string()
                .contains("node.key is not the key of node.pem"),
            "{e}"
        );
    }

    #[test]
    fn utc_names_the_civil_time() {
        assert_eq!(super::utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::utc(1_796_583_062), "2026-12-06T18:51:02Z");
        assert_eq!(super::utc(-1), "1969-12-31T23:59:59Z");
    }
}
