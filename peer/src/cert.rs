//! Cluster certificates: a cluster CA and node certificates it signs
//! (rcgen), and loading them back (x509-parser).
//!
//! Identity lives in the certificate:
//! - the cluster id as a SAN URI `kvtier://cluster/NAME` (CA and nodes) and
//!   the subject `O=kvtier cluster NAME`;
//! - the node name as a SAN URI `kvtier://node/NAME`, the subject CN and a
//!   SAN DNS name.
//!
//! Files (PEM): `init-ca` writes `ca.pem` + `ca.key`; `issue` writes
//! `ca.pem`, `node.pem` and `node.key`. Key files are created 0600.

use std::fs;
use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::Error;

/// SAN URI prefix carrying the cluster id.
pub const CLUSTER_URI_PREFIX: &str = "kvtier://cluster/";
/// SAN URI prefix carrying the node name.
pub const NODE_URI_PREFIX: &str = "kvtier://node/";
/// CA certificate file name.
pub const CA_CERT_FILE: &str = "ca.pem";
/// CA key file name (only in the CA directory).
pub const CA_KEY_FILE: &str = "ca.key";
/// Node certificate file name.
pub const NODE_CERT_FILE: &str = "node.pem";
/// Node key file name.
pub const NODE_KEY_FILE: &str = "node.key";

fn cert_err(what: impl Into<String>, detail: impl std::fmt::Display) -> Error {
    Error::Cert {
        what: what.into(),
        detail: detail.to_string(),
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// Checks a cluster or node name: at most 63 characters, dot-separated
/// labels of `[A-Za-z0-9-]` that start and end with a letter or digit, and
/// not an IP address. A node name is its certificate's DNS name, which peers
/// verify: `n1..x`, `n1.` or `10.0.0.1` would be issued, and then refused by
/// every peer that dials the node.
pub fn validate_name(kind: &str, name: &str) -> Result<(), Error> {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    // Also as peers verify it: rustls refuses a name whose last label is a
    // number (`127.1`, `1.2.3`), which would be issued and never accepted.
    let ok = name.len() <= 63
        && name.parse::<IpAddr>().is_err()
        && name.split('.').all(label_ok)
        && rustls::pki_types::DnsName::try_from(name).is_ok()
        && !name
            .rsplit('.')
            .next()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()));
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid {kind} name {name:?}: use at most 63 characters, dot-separated labels of \
             [A-Za-z0-9-] each starting and ending with a letter or digit (no empty label, no \
             trailing dot, not an IP address)"
        )))
    }
}

/// Checks an extra DNS name for a certificate: dot-separated labels of
/// 1-63 characters of [A-Za-z0-9-], none starting or ending with `-`, at
/// most 253 characters in all (a name a TLS client could ever match).
pub fn validate_dns_name(name: &str) -> Result<(), Error> {
    if name.parse::<IpAddr>().is_ok() {
        return Err(Error::Config(format!(
            "{name:?} is an IP address, not a DNS name: give it with --ip"
        )));
    }
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if name.len() <= 253 && name.split('.').all(label_ok) {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid DNS name {name:?}: use dot-separated labels of 1-63 characters of [A-Za-z0-9-], not starting or ending with '-' (no wildcards, no trailing dot; addresses go to --ip)"
        )))
    }
}

/// Validity window of a new certificate.
#[derive(Debug, Clone, Copy)]
pub struct Validity {
    /// Start.
    pub not_before: SystemTime,
    /// End.
    pub not_after: SystemTime,
}

impl Validity {
    /// From one hour ago (clock skew) for `days` days.
    pub fn days(days: u32) -> Self {
        let now = SystemTime::now();
        Self {
            not_before: now - Duration::from_secs(3600),
            not_after: now + Duration::from_secs(u64::from(days) * 86_400),
        }
    }
}

/// A cluster CA in memory (certificate and key, PEM).
pub struct CaMaterial {
    /// Cluster id.
    pub cluster: String,
    /// CA certificate, PEM.
    pub cert_pem: String,
    /// CA private key, PEM.
    pub key_pem: String,
}

/// A node's files in memory (PEM).
pub struct NodeMaterial {
    /// CA certificate, PEM.
    pub ca_pem: String,
    /// Node certificate, PEM.
    pub cert_pem: String,
    /// Node private key, PEM.
    pub key_pem: String,
}

/// Creates a new cluster CA.
pub fn init_ca(cluster: &str, validity: Validity) -> Result<CaMaterial, Error> {
    validate_name("cluster", cluster)?;
    let key = KeyPair::generate().map_err(|e| cert_err("generate CA key", e))?;
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("kvtier CA {cluster}"));
    dn.push(
        DnType::OrganizationName,
        format!("kvtier cluster {cluster}"),
    );
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.subject_alt_names = vec![SanType::URI(
        format!("{CLUSTER_URI_PREFIX}{cluster}")
            .try_into()
            .map_err(|e| cert_err("cluster URI", e))?,
    )];
    p.not_before = validity.not_before.into();
    p.not_after = validity.not_after.into();
    let cert = p
        .self_signed(&key)
        .map_err(|e| cert_err("self-sign CA", e))?;
    Ok(CaMaterial {
        cluster: cluster.to_owned(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Issues a node certificate signed by `ca`. `node` becomes the CN, a SAN
/// DNS name and the SAN URI `kvtier://node/NODE`; `ips` and `dns` are extra
/// SANs.
pub fn issue(
    ca: &CaMaterial,
    node: &str,
    ips: &[IpAddr],
    dns: &[String],
    validity: Validity,
) -> Result<NodeMaterial, Error> {
    validate_name("node", node)?;
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(|e| cert_err("parse CA key", e))?;
    ca.check_pair(&ca_key)?;
    let ca_params = CertificateParams::from_ca_cert_pem(&ca.cert_pem)
        .map_err(|e| cert_err("parse CA certificate", e))?;
    // rcgen signs with an issuer `Certificate`; rebuilding it from the
    // parsed params keeps the CA's subject and key id.
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .map_err(|e| cert_err("load CA as issuer", e))?;
    let key = KeyPair::generate().map_err(|e| cert_err("generate node key", e))?;
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, node);
    dn.push(
        DnType::OrganizationName,
        format!("kvtier cluster {}", ca.cluster),
    );
    p.distinguished_name = dn;
    // No basic constraints extension: an end entity. rcgen's `ExplicitNoCa`
    // encodes `cA FALSE`, a default value, which DER forbids (QA: Python
    // `cryptography` refused to parse the node certificates).
    p.is_ca = IsCa::NoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let mut sans = vec![
        SanType::URI(
            format!("{CLUSTER_URI_PREFIX}{}", ca.cluster)
                .try_into()
                .map_err(|e| cert_err("cluster URI", e))?,
        ),
        SanType::URI(
            format!("{NODE_URI_PREFIX}{node}")
                .try_into()
                .map_err(|e| cert_err("node URI", e))?,
        ),
        SanType::DnsName(node.try_into().map_err(|e| cert_err("node DNS name", e))?),
    ];
    for d in dns {
        validate_dns_name(d)?;
        sans.push(SanType::DnsName(
            d.as_str()
                .try_into()
                .map_err(|e| cert_err(format!("DNS name {d}"), e))?,
        ));
    }
    for ip in ips {
        sans.push(SanType::IpAddress(*ip));
    }
    p.subject_alt_names = sans;
    p.not_before = validity.not_before.into();
    // A node certificate is worth nothing past its CA's end; from an
    // expired CA it would be worth nothing at all.
    let ca_end = ca.not_after()?;
    if ca_end <= SystemTime::now() {
        return Err(Error::Config(format!(
            "the CA of cluster {} has expired: create a new one with `kvtier cert init-ca` and reissue every node's certificate",
            ca.cluster
        )));
    }
    p.not_after = validity.not_after.min(ca_end).into();
    let cert = p
        .signed_by(&key, &ca_cert, &ca_key)
        .map_err(|e| cert_err("sign node certificate", e))?;
    Ok(NodeMaterial {
        ca_pem: ca.cert_pem.clone(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Refuses before anything is written when one of `files` exists in
/// `dir`, so a refused write leaves no partial set behind.
fn check_none_exist(dir: &Path, files: &[&str]) -> Result<(), Error> {
    if dir.symlink_metadata().is_ok() && !dir.is_dir() {
        return Err(io_err(format!("create {}", dir.display()))(
            std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "it exists and is not a directory: --out names the directory to write into",
            ),
        ));
    }
    for f in files {
        let path = dir.join(f);
        if path.symlink_metadata().is_ok() {
            return Err(io_err(format!("create {}", path.display()))(
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "file exists; nothing was written (move it away or pick another --out)",
                ),
            ));
        }
    }
    Ok(())
}

/// Writes `contents` to `path`, refusing to overwrite; `secret` files get
/// mode 0600.
fn write_new(path: &Path, contents: &str, secret: bool) -> Result<(), Error> {
    let mut o = fs::OpenOptions::new();
    o.write(true).create_new(true);
    o.mode(if secret { 0o600 } else { 0o644 });
    let mut f = o
        .open(path)
        .map_err(io_err(format!("create {}", path.display())))?;
    f.write_all(contents.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(io_err(format!("write {}", path.display())))
}

fn read_file(path: &Path) -> Result<String, Error> {
    fs::read_to_string(path).map_err(io_err(format!("read {}", path.display())))
}

impl CaMaterial {
    /// Writes `ca.pem` and `ca.key` (0600) into `dir` (created if needed);
    /// refuses to overwrite existing files.
    pub fn write_to(&self, dir: &Path) -> Result<(), Error> {
        check_none_exist(dir, &[CA_KEY_FILE, CA_CERT_FILE])?;
        fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        write_new(&dir.join(CA_KEY_FILE), &self.key_pem, true)?;
        write_new(&dir.join(CA_CERT_FILE), &self.cert_pem, false)
    }

    /// When the CA certificate expires (a node certificate it issues ends
    /// then at the latest).
    pub fn not_after(&self) -> Result<SystemTime, Error> {
        let der = pem_certs(&self.cert_pem, "CA certificate")?;
        let first = der
            .first()
            .ok_or_else(|| cert_err("CA certificate", "no certificate in ca.pem"))?;
        let (_, c) = x509_parser::parse_x509_certificate(first)
            .map_err(|e| cert_err("parse CA certificate", e))?;
        let secs = u64::try_from(c.validity().not_after.timestamp()).unwrap_or(0);
        Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
    }

    /// Checks that `ca.pem` is a CA certificate and that `key` is its key:
    /// a certificate signed otherwise would be refused by every peer.
    fn check_pair(&self, key: &KeyPair) -> Result<(), Error> {
        let der = pem_certs(&self.cert_pem, "CA certificate")?;
        let first = der
            .first()
            .ok_or_else(|| cert_err("CA certificate", "no certificate in ca.pem"))?;
        let (_, c) = x509_parser::parse_x509_certificate(first)
            .map_err(|e| cert_err("parse CA certificate", e))?;
        if !c.is_ca() {
            return Err(cert_err(
                "CA certificate",
                "ca.pem is not a CA certificate (no CA basic constraint): give the directory \
                 `kvtier cert init-ca` wrote",
            ));
        }
        if c.public_key().raw != key.public_key_der().as_slice() {
            return Err(cert_err(
                "CA key",
                "ca.key is not the key of ca.pem: the two files come from different CAs",
            ));
        }
        Ok(())
    }

    /// Reads `ca.pem` and `ca.key` from `dir`; the cluster id comes from the
    /// CA certificate.
    pub fn read_from(dir: &Path) -> Result<Self, Error> {
        let cert_pem = read_file(&dir.join(CA_CERT_FILE))?;
        let key_pem = read_file(&dir.join(CA_KEY_FILE))?;
        let der = pem_certs(&cert_pem, "CA certificate")?;
        let first = der
            .first()
            .ok_or_else(|| cert_err("CA certificate", "no certificate in ca.pem"))?;
        let id = CertIdentity::parse(first)?;
        let cluster = id
            .cluster
            .ok_or_else(|| cert_err("CA certificate", "carries no kvtier://cluster/ URI"))?;
        Ok(Self {
            cluster,
            cert_pem,
            key_pem,
        })
    }
}

/// A warning when `dir/node.key` is open to the group or others: the key
/// authenticates this node to the whole cluster. `cert issue` writes it
/// 0600.
pub fn key_exposure(dir: &Path) -> Option<String> {
    exposure(
        &dir.join(NODE_KEY_FILE),
        "the key that admits this node to the cluster",
    )
}

/// A warning when `dir/ca.key` is open to the group or others: with it
/// anyone can admit a node to the cluster (`cert issue` reads it).
pub fn ca_key_exposure(dir: &Path) -> Option<String> {
    exposure(
        &dir.join(CA_KEY_FILE),
        "the CA key, which admits any node to the cluster",
    )
}

fn exposure(path: &Path, what: &str) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then(|| {
        format!(
            "{} has mode {mode:04o}: the group or others can read {what}; `chmod 600` it",
            path.display()
        )
    })
}

impl NodeMaterial {
    /// Writes `ca.pem`, `node.pem` and `node.key` (0600) into `dir`.
    pub fn write_to(&self, dir: &Path) -> Result<(), Error> {
        check_none_exist(dir, &[NODE_KEY_FILE, NODE_CERT_FILE, CA_CERT_FILE])?;
        fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        write_new(&dir.join(NODE_KEY_FILE), &self.key_pem, true)?;
        write_new(&dir.join(NODE_CERT_FILE), &self.cert_pem, false)?;
        write_new(&dir.join(CA_CERT_FILE), &self.ca_pem, false)
    }

    /// Reads the three files from `dir`.
    pub fn read_from(dir: &Path) -> Result<Self, Error> {
        Ok(Self {
            ca_pem: read_file(&dir.join(CA_CERT_FILE))?,
            cert_pem: read_file(&dir.join(NODE_CERT_FILE))?,
            key_pem: read_file(&dir.join(NODE_KEY_FILE))?,
        })
    }
}

/// Parses all certificates in a PEM string.
pub fn pem_certs(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, Error> {
    let mut rd = pem.as_bytes();
    let v: Result<Vec<_>, _> = rustls_pemfile::certs(&mut rd).collect();
    let v = v.map_err(|e| cert_err(format!("parse {what}"), e))?;
    if v.is_empty() {
        return Err(cert_err(format!("parse {what}"), "no CERTIFICATE block"));
    }
    Ok(v)
}

/// Parses the private key in a PEM string.
pub fn pem_key(pem: &str) -> Result<PrivateKeyDer<'static>, Error> {
    let mut rd = pem.as_bytes();
    rustls_pemfile::private_key(&mut rd)
        .map_err(|e| cert_err("parse private key", e))?
        .ok_or_else(|| cert_err("parse private key", "no PRIVATE KEY block"))
}

/// The kvtier identity a certificate carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertIdentity {
    /// Cluster id from the `kvtier://cluster/` SAN URI.
    pub cluster: Option<String>,
    /// Node name from the `kvtier://node/` SAN URI (or the CN).
    pub node: Option<String>,
    /// End of validity, seconds since the Unix epoch.
    pub not_after: i64,
    /// Start of validity, seconds since the Unix epoch.
    pub not_before: i64,
}

impl CertIdentity {
    /// Parses a DER certificate.
    pub fn parse(der: &[u8]) -> Result<Self, Error> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| cert_err("parse certificate", e))?;
        let mut cluster = None;
        let mut node = None;
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for n in &san.value.general_names {
                if let x509_parser::extensions::GeneralName::URI(u) = n {
                    if let Some(c) = u.strip_prefix(CLUSTER_URI_PREFIX) {
                        cluster = Some(c.to_owned());
                    } else if let Some(c) = u.strip_prefix(NODE_URI_PREFIX) {
                        node = Some(c.to_owned());
                    }
                }
            }
        }
        if node.is_none() {
            node = cert
                .subject()
                .iter_common_name()
                .next()
                .and_then(|cn| cn.as_str().ok())
                .map(str::to_owned);
        }
        Ok(Self {
            cluster,
            node,
            not_after: cert.validity().not_after.timestamp(),
            not_before: cert.validity().not_before.timestamp(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ca_and_node_carry_identity() {
        let ca = init_ca("prod", Validity::days(30)).expect("ca");
        let node = issue(
            &ca,
            "spark-1",
            &["127.0.0.1".parse().expect("ip")],
            &[],
            Validity::days(10),
        )
        .expect("issue");
        let der = pem_certs(&node.cert_pem, "node").expect("pem");
        let id = CertIdentity::parse(&der[0]).expect("parse");
        assert_eq!(id.cluster.as_deref(), Some("prod"));
        assert_eq!(id.node.as_deref(), Some("spark-1"));
        let ca_id =
            CertIdentity::parse(&pem_certs(&ca.cert_pem, "ca").expect("pem")[0]).expect("parse");
        assert_eq!(ca_id.cluster.as_deref(), Some("prod"));
        pem_key(&node.key_pem).expect("key parses");
        // Strict DER: the node certificate is no CA and carries no basic
        // constraints extension (one with `cA FALSE` spelled out is not
        // DER, and strict parsers refuse it).
        let (_, c) = x509_parser::parse_x509_certificate(&der[0]).expect("x509");
        assert!(!c.is_ca());
        assert!(c.basic_constraints().expect("unique").is_none());
    }

    #[test]
    fn files_round_trip_with_0600_keys() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let ca = init_ca("c1", Validity::days(1)).expect("ca");
        ca.write_to(&dir.path().join("ca")).expect("write ca");
        assert!(
            ca.write_to(&dir.path().join("ca")).is_err(),
            "never overwrites"
        );
        let ca2 = CaMaterial::read_from(&dir.path().join("ca")).expect("read ca");
        assert_eq!(ca2.cluster, "c1");
        let n = issue(&ca2, "n1", &[], &["n1.example".into()], Validity::days(1)).expect("issue");
        n.write_to(&dir.path().join("n1")).expect("write node");
        let mode = fs::metadata(dir.path().join("n1").join(NODE_KEY_FILE))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let mode = fs::metadata(dir.path().join("ca").join(CA_KEY_FILE))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        NodeMaterial::read_from(&dir.path().join("n1")).expect("read node");
    }

    /// A CA directory whose files do not belong together is refused before
    /// anything is signed (QA: `issue` signed with another CA's key, and
    /// took a node certificate for a CA; every peer then refused the node).
    #[test]
    fn issue_checks_the_ca_files_belong_together() {
        let a = init_ca("c1", Validity::days(1)).expect("ca");
        let b = init_ca("c1", Validity::days(1)).expect("ca");
        let mixed = CaMaterial {
            cluster: a.cluster.clone(),
            cert_pem: a.cert_pem.clone(),
            key_pem: b.key_pem.clone(),
        };
        let Err(err) = issue(&mixed, "n1", &[], &[], Validity::days(1)) else {
            panic!("issued with another CA's key");
        };
        let err = err.to_string();
        assert!(err.contains("ca.key is not the key of ca.pem"), "{err}");
        let node = issue(&a, "n1", &[], &[], Validity::days(1)).expect("issue");
        let not_ca = CaMaterial {
            cluster: "c1".into(),
            cert_pem: node.cert_pem,
            key_pem: node.key_pem,
        };
        let Err(err) = issue(&not_ca, "n2", &[], &[], Validity::days(1)) else {
            panic!("issued with a node certificate as CA");
        };
        let err = err.to_string();
        assert!(err.contains("not a CA certificate"), "{err}");
        issue(&b, "n1", &[], &[], Validity::days(1)).expect("a matching pair");
    }

    #[test]
    fn bad_names_rejected() {
        for bad in [
            "",
            "-x",
            "a b",
            "x/y",
            "a_b",
            &"a".repeat(64),
            // Peers verify the name as a DNS name (QA: these were issued).
            "n1..x",
            "n1.",
            ".n1",
            "n1-.lan",
            "n1.-lan",
            "10.0.0.1",
            "127.1",
            "1.2.3",
            "12345",
            "0x0a000001",
        ] {
            assert!(validate_name("node", bad).is_err(), "{bad:?}");
        }
        for good in ["spark-2.lan", "n1", "2spark", "a.b.c"] {
            validate_name("node", good).expect(good);
        }
    }

    #[test]
    fn bad_dns_names_are_refused_before_signing() {
        let ca = init_ca("c1", Validity::days(1)).expect("ca");
        for bad in [
            "",
            "a b",
            "a..b",
            "-a.lan",
            "a-.lan",
            "x/y",
            "ä.lan",
            &"a".repeat(64),
        ] {
            assert!(validate_dns_name(bad).is_err(), "{bad:?}");
            let e = issue(&ca, "n1", &[], &[bad.to_string()], Validity::days(1))
                .err()
                .unwrap_or_else(|| panic!("{bad:?} was signed"));
            assert!(e.to_string().contains("invalid DNS name"), "{e}");
        }
        let e = validate_dns_name("10.0.0.1").unwrap_err();
        assert!(e.to_string().contains("--ip"), "{e}");
        for good in ["n1", "spark-2.lan", "10-0-0-1.nodes.example.com"] {
            validate_dns_name(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
    }

    #[test]
    fn a_refused_write_leaves_nothing_behind() {
        let dir = tempfile::tempdir().expect("tmp");
        let ca = init_ca("c1", Validity::days(1)).expect("ca");
        ca.write_to(dir.path()).expect("write ca");
        // Issuing into the CA's own directory: ca.pem is there, so none of
        // the node files may be written (they were, before the check).
        let n = issue(&ca, "n1", &[], &[], Validity::days(1)).expect("issue");
        let e = n.write_to(dir.path()).expect_err("ca.pem exists");
        assert!(e.to_string().contains("nothing was written"), "{e}");
        for f in [NODE_KEY_FILE, NODE_CERT_FILE] {
            assert!(!dir.path().join(f).exists(), "{f} was written");
        }
        // And a CA over a node key alone is refused whole too.
        let other = tempfile::tempdir().expect("tmp");
        fs::write(other.path().join(CA_CERT_FILE), "x").expect("write");
        assert!(ca.write_to(other.path()).is_err());
        assert!(!other.path().join(CA_KEY_FILE).exists());
    }

    #[test]
    fn a_node_certificate_ends_no_later_than_its_ca() {
        let ca = init_ca("c1", Validity::days(2)).expect("ca");
        let ca_end = ca.not_after().expect("ca end");
        let n = issue(&ca, "n1", &[], &[], Validity::days(400)).expect("issue");
        let der = pem_certs(&n.cert_pem, "node").expect("pem");
        let (_, c) = x509_parser::parse_x509_certificate(&der[0]).expect("parse");
        let end =
            SystemTime::UNIX_EPOCH + Duration::from_secs(c.validity().not_after.timestamp() as u64);
        assert_eq!(end, ca_end);
        // An expired CA signs nothing.
        let now = SystemTime::now();
        let old = init_ca(
            "c1",
            Validity {
                not_before: now - Duration::from_secs(7200),
                not_after: now - Duration::from_secs(60),
            },
        )
        .expect("ca");
        let e = issue(&old, "n1", &[], &[], Validity::days(1))
            .err()
            .expect("an expired CA is refused");
        assert!(e.to_string().contains("has expired"), "{e}");
        let n = issue(&ca, "n1", &[], &[], Validity::days(1)).expect("issue");
        let der = pem_certs(&n.cert_pem, "node").expect("pem");
        let (_, c) = x509_parser::parse_x509_certificate(&der[0]).expect("parse");
        assert!(
            (c.validity().not_after.timestamp() as u64)
                < ca_end
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .expect("epoch")
                    .as_secs()
        );
    }
}
