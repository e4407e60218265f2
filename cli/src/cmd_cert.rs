//! `kvtier cert init-ca | issue`: the cluster CA and node certificates
//! (rcgen, through `node::peer::cert`). Key files are written 0600 and
//! existing files are never overwritten.

use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use node::peer::cert::{self, CaMaterial, Validity};

use crate::EXIT_OK;

/// `kvtier cert ...`
#[derive(Debug, Subcommand)]
pub enum CertCommand {
    /// Create a cluster CA: writes ca.pem and ca.key (0600) into --out.
    InitCa(InitCaArgs),
    /// Issue a node certificate signed by the CA: writes ca.pem, node.pem
    /// and node.key (0600) into --out, exactly what a node's tls-dir needs.
    Issue(IssueArgs),
}

/// `kvtier cert init-ca`
#[derive(Debug, Args)]
pub struct InitCaArgs {
    /// Cluster id carried by every certificate of this CA (at most 63
    /// characters: dot-separated labels of [A-Za-z0-9-]).
    #[arg(long, value_name = "NAME", value_parser = cluster_name)]
    pub cluster: String,
    /// Directory to write into (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Validity in days (1-36500).
    #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u32).range(1..=36500))]
    pub days: u32,
}

/// `kvtier cert issue`
#[derive(Debug, Args)]
pub struct IssueArgs {
    /// The CA directory written by `init-ca`.
    #[arg(long, value_name = "DIR")]
    pub ca: PathBuf,
    /// Node name (the daemon's --node-name; CN and SAN DNS name): at most
    /// 63 characters, dot-separated labels of [A-Za-z0-9-], not an IP
    /// address (addresses go to --ip).
    #[arg(long, value_name = "NAME", value_parser = node_name)]
    pub node: String,
    /// Extra IP address SANs (repeatable).
    #[arg(long, value_name = "IP")]
    pub ip: Vec<IpAddr>,
    /// Extra DNS name SANs (repeatable).
    #[arg(long, value_name = "NAME", value_parser = dns_name)]
    pub dns: Vec<String>,
    /// Directory to write into. Default: ./NODE.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Validity in days (1-36500; never past the CA's own end).
    #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=36500))]
    pub days: u32,
}

// Malformed names are usage errors (exit 2), checked as the flags are
// parsed, with the rules `cert` itself applies.
fn cluster_name(s: &str) -> Result<String, String> {
    name_rule(cert::validate_name("cluster", s), s)
}

fn node_name(s: &str) -> Result<String, String> {
    name_rule(cert::validate_name("node", s), s)
}

fn dns_name(s: &str) -> Result<String, String> {
    name_rule(cert::validate_dns_name(s), s)
}

fn name_rule(r: Result<(), node::peer::Error>, s: &str) -> Result<String, String> {
    match r {
        Ok(()) => Ok(s.to_owned()),
        Err(node::peer::Error::Config(why)) => Err(why),
        Err(e) => Err(e.to_string()),
    }
}

/// Runs a `kvtier cert` command.
pub fn run(cmd: &CertCommand) -> Result<u8> {
    match cmd {
        CertCommand::InitCa(a) => {
            let ca = cert::init_ca(&a.cluster, Validity::days(a.days)).context("create the CA")?;
            ca.write_to(&a.out)
                .with_context(|| format!("write the CA into {}", a.out.display()))?;
            outln!(
                "cluster {}: wrote {} and {} (keep the key offline)",
                a.cluster,
                a.out.join(cert::CA_CERT_FILE).display(),
                a.out.join(cert::CA_KEY_FILE).display()
            );
        }
        CertCommand::Issue(a) => {
            let ca = CaMaterial::read_from(&a.ca)
                .with_context(|| format!("read the CA from {}", a.ca.display()))?;
            if let Some(w) = cert::ca_key_exposure(&a.ca) {
                errln!("warning: {w}");
            }
            let validity = Validity::days(a.days);
            let ca_end = ca.not_after().context("read the CA's validity")?;
            // (An expired CA is refused by the issue below.)
            // Worth a note when it cuts at least a day (`--days 10` of a
            // 10-day CA issued a minute later ends a minute early: no note).
            let day = std::time::Duration::from_secs(86_400);
            if validity.not_after > ca_end + day && ca_end > std::time::SystemTime::now() {
                // Rounded up: a CA with hours left has "1 day" left.
                let left = ca_end
                    .duration_since(std::time::SystemTime::now())
                    .map_or(0, |d| d.as_secs().div_ceil(86_400));
                errln!(
                    "note: the CA expires in {left} day(s), before --days {}: the certificate ends with it (renew the CA before then)",
                    a.days
                );
            }
            let node = cert::issue(&ca, &a.node, &a.ip, &a.dns, validity)
                .with_context(|| format!("issue a certificate for {}", a.node))?;
            let out = a.out.clone().unwrap_or_else(|| PathBuf::from(&a.node));
            node.write_to(&out)
                .with_context(|| format!("write the node files into {}", out.display()))?;
            outln!(
                "node {} (cluster {}): wrote {}, {}, {}",
                a.node,
                ca.cluster,
                out.join(cert::CA_CERT_FILE).display(),
                out.join(cert::NODE_CERT_FILE).display(),
                out.join(cert::NODE_KEY_FILE).display()
            );
        }
    }
    Ok(EXIT_OK)
}
