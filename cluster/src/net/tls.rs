//! The cluster's certificate authority, node certificates, and the mutual-TLS configurations built
//! from them. There is no plaintext path: a node speaks only to peers whose certificate the cluster
//! CA signed.
//!
//! State directory layout (written by `legion-rs up`, read by workers):
//!
//! ```text
//! <state>/ca/ca.pem              cluster CA certificate
//! <state>/ca/ca.key              cluster CA private key (0600; only the launcher needs it)
//! <state>/nodes/<name>/cert.pem  node certificate, signed by the CA
//! <state>/nodes/<name>/key.pem   node private key (0600)
//! <state>/nodes/<name>/ca.pem    copy of the CA certificate: a node directory is self-contained
//! ```

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Negotiated by both sides: a peer for another protocol (or version) fails the handshake.
pub const ALPN: &[u8] = b"legion-rs/1";

const CA_COMMON_NAME: &str = "legion-rs cluster CA";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    #[error("invalid node name {0:?}: use letters, digits, '-' and '.'")]
    NodeName(String),
}

/// The cluster CA: signs node certificates.
pub struct ClusterCa {
    key: KeyPair,
    cert_pem: String,
}

/// The parameters the CA certificate is made from. They are rebuilt identically when the CA is
/// loaded, which is all rcgen needs to sign (issuer name and key identifier come from them and the
/// key), so loading needs no X.509 parser.
fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

impl ClusterCa {
    pub fn generate() -> Result<ClusterCa, TlsError> {
        let key = KeyPair::generate()?;
        let cert_pem = ca_params().self_signed(&key)?.pem();
        Ok(ClusterCa { key, cert_pem })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for node `name`, valid for `name`, `localhost` and each of `addresses` (host
    /// names or IP addresses the node is reached at).
    pub fn issue(&self, name: &str, addresses: &[String]) -> Result<NodeIdentity, TlsError> {
        check_node_name(name)?;
        let mut sans = vec![name.to_string(), "localhost".to_string()];
        for a in addresses {
            if !sans.contains(a) {
                sans.push(a.clone());
            }
        }
        let mut params = CertificateParams::new(sans)?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // Every node is both a server (accepts peers) and a client (dials peers).
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let issuer = Issuer::new(ca_params(), &self.key);
        let cert = params.signed_by(&key, &issuer)?;
        Ok(NodeIdentity {
            name: name.to_string(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            ca_pem: self.cert_pem.clone(),
        })
    }

    pub fn save(&self, state: &Path) -> Result<(), TlsError> {
        let dir = state.join("ca");
        create_dir(&dir)?;
        write(&dir.join("ca.pem"), &self.cert_pem, false)?;
        write(&dir.join("ca.key"), &self.key.serialize_pem(), true)
    }

    pub fn load(state: &Path) -> Result<ClusterCa, TlsError> {
        let dir = state.join("ca");
        let cert_pem = read(&dir.join("ca.pem"))?;
        let key_path = dir.join("ca.key");
        let key = KeyPair::from_pem(&read(&key_path)?).map_err(|e| TlsError::Pem {
            path: key_path,
            what: e.to_string(),
        })?;
        Ok(ClusterCa { key, cert_pem })
    }
}

/// The certificate name of a host named `host_name`: host names may be `address:port` (several
/// workers on one address), which is not a DNS name; other characters become `-`.
pub fn node_name(host_name: &str) -> String {
    let name: String = host_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    name.trim_start_matches(['-', '.']).to_string()
}

fn check_node_name(name: &str) -> Result<(), TlsError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        && !name.starts_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(TlsError::NodeName(name.to_string()))
    }
}

/// A node's certificate and key, and the CA it trusts.
#[derive(Clone)]
pub struct NodeIdentity {
    pub name: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the private key.
        f.debug_struct("NodeIdentity")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl NodeIdentity {
    pub fn dir(state: &Path, name: &str) -> PathBuf {
        state.join("nodes").join(name)
    }

    pub fn save(&self, state: &Path) -> Result<(), TlsError> {
        let dir = NodeIdentity::dir(state, &self.name);
        create_dir(&dir)?;
        write(&dir.join("cert.pem"), &self.cert_pem, false)?;
        write(&dir.join("key.pem"), &self.key_pem, true)?;
        write(&dir.join("ca.pem"), &self.ca_pem, false)
    }

    pub fn load(state: &Path, name: &str) -> Result<NodeIdentity, TlsError> {
        check_node_name(name)?;
        let dir = NodeIdentity::dir(state, name);
        Ok(NodeIdentity {
            name: name.to_string(),
            cert_pem: read(&dir.join("cert.pem"))?,
            key_pem: read(&dir.join("key.pem"))?,
            ca_pem: read(&dir.join("ca.pem"))?,
        })
    }

    /// Both TLS configurations, checked: a PEM that does not parse is reported here, not at the
    /// first connection.
    pub fn tls(&self) -> Result<NodeTls, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let pem_err = |what: &str, e: rustls::pki_types::pem::Error| TlsError::Pem {
            path: PathBuf::from(&self.name),
            what: format!("{what}: {e}"),
        };
        let ca = CertificateDer::from_pem_slice(self.ca_pem.as_bytes())
            .map_err(|e| pem_err("CA certificate", e))?;
        let cert = CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .map_err(|e| pem_err("node certificate", e))?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|e| pem_err("node key", e))?;
        let mut roots = RootCertStore::empty();
        roots.add(ca)?;
        let roots = Arc::new(roots);

        let verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build()?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![cert.clone()], key.clone_key())?;
        server.alpn_protocols = vec![ALPN.to_vec()];

        let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_client_auth_cert(vec![cert], key)?;
        client.alpn_protocols = vec![ALPN.to_vec()];

        Ok(NodeTls {
            name: self.name.clone(),
            server: Arc::new(server),
            client: Arc::new(client),
            provider,
        })
    }
}

/// A node's mutual-TLS configurations.
#[derive(Clone, Debug)]
pub struct NodeTls {
    pub name: String,
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
    pub provider: Arc<CryptoProvider>,
}

fn create_dir(dir: &Path) -> Result<(), TlsError> {
    fs::create_dir_all(dir).map_err(|source| TlsError::Io {
        path: dir.to_path_buf(),
        source,
    })
}

fn read(path: &Path) -> Result<String, TlsError> {
    fs::read_to_string(path).map_err(|source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes atomically (`legion_ops::atomic_file`), so a reader never sees half a key; a secret is
/// made owner-only before any byte is written.
fn write(path: &Path, contents: &str, secret: bool) -> Result<(), TlsError> {
    use std::io::Write;
    let io = |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let temp = legion_ops::atomic_file::AtomicFile::create_beside(path).map_err(io)?;
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::PermissionsExt;
        temp.file()
            .set_permissions(fs::Permissions::from_mode(0o600))
            .map_err(io)?;
    }
    #[cfg(not(unix))]
    let _ = secret;
    temp.file().write_all(contents.as_bytes()).map_err(io)?;
    temp.commit(path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_become_certificate_names() {
        assert_eq!(node_name("node0"), "node0");
        assert_eq!(node_name("127.0.0.1:7401"), "127.0.0.1-7401");
        assert_eq!(node_name("[::1]:7401"), "1--7401");
        assert!(check_node_name(&node_name("127.0.0.1:7401")).is_ok());
    }

    #[test]
    fn ca_and_node_round_trip_through_the_state_directory() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::generate().unwrap();
        ca.save(dir.path()).unwrap();
        let loaded = ClusterCa::load(dir.path()).unwrap();
        assert_eq!(loaded.cert_pem(), ca.cert_pem());
        // A CA loaded back still signs certificates the peers accept.
        let node = loaded.issue("node-1", &["10.0.0.7".into()]).unwrap();
        node.save(dir.path()).unwrap();
        let back = NodeIdentity::load(dir.path(), "node-1").unwrap();
        assert_eq!(back.cert_pem, node.cert_pem);
        back.tls().unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.path().join("nodes/node-1/key.pem"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "key readable by others: {mode:o}");
        }
    }

    #[test]
    fn node_names_are_checked() {
        let ca = ClusterCa::generate().unwrap();
        assert!(matches!(
            ca.issue("../etc", &[]),
            Err(TlsError::NodeName(_))
        ));
        assert!(matches!(ca.issue("", &[]), Err(TlsError::NodeName(_))));
    }
}
