//! `legion-rs up` through the real `ssh` client: the test starts an OpenSSH server on a loopback
//! port with a throwaway host key and client key, and the hosts file reaches the workers as
//! `ssh://root@127.0.0.1:PORT`. Skipped with a printed reason where sshd is not installed or
//! cannot start (it needs root for a login as root).

mod common;

use common::{assert_same_tensors, free_tcp_port, free_udp_port, init_checkpoint, ok, train_from};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SSHD: &str = "/usr/sbin/sshd";

struct Sshd {
    child: Child,
    port: u16,
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keygen(path: &Path) -> Result<(), String> {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .output()
        .map_err(|e| format!("ssh-keygen: {e}"))?;
    out.status
        .success()
        .then_some(())
        .ok_or_else(|| format!("ssh-keygen: {}", String::from_utf8_lossy(&out.stderr)))
}

/// An sshd on a free loopback port that lets in the key `dir/client`.
fn start_sshd(dir: &Path) -> Result<Sshd, String> {
    if !Path::new(SSHD).exists() {
        return Err(format!("{SSHD} is not installed (Debian: openssh-server)"));
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root".into());
    }
    keygen(&dir.join("host"))?;
    keygen(&dir.join("client"))?;
    std::fs::copy(dir.join("client.pub"), dir.join("authorized_keys")).unwrap();
    // sshd's privilege separation needs this directory; a fresh container may lack it.
    std::fs::create_dir_all("/run/sshd").map_err(|e| format!("/run/sshd: {e}"))?;
    let port = free_tcp_port();
    let config = format!(
        "Port {port}\nListenAddress 127.0.0.1\nHostKey {host}\nAuthorizedKeysFile {keys}\n\
         PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n\
         StrictModes no\nUsePAM no\nPidFile {pid}\n",
        host = dir.join("host").display(),
        keys = dir.join("authorized_keys").display(),
        pid = dir.join("sshd.pid").display(),
    );
    std::fs::write(dir.join("sshd_config"), config).unwrap();
    let child = Command::new(SSHD)
        .args(["-D", "-e", "-f"])
        .arg(dir.join("sshd_config"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{SSHD}: {e}"))?;
    let sshd = Sshd { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err(format!("sshd did not listen on port {port}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(sshd)
}

fn legion_with_ssh(ssh: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_legion-rs"))
        .args(args)
        .env("LEGION_RS_SSH", ssh)
        .output()
        .expect("legion-rs runs")
}

#[test]
fn up_through_ssh_trains_and_down_stops_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let sshd = match start_sshd(dir.path()) {
        Ok(s) => s,
        Err(e) => {
            return legion_ops::require::skip(
                legion_ops::require::Need::Ssh,
                format!("cannot run an ssh server here ({e})"),
            );
        }
    };
    let ssh = format!(
        "ssh -i {} -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
        dir.path().join("client").display()
    );
    // One host names its binary (the one under test), the other uses the launcher's own path.
    let mut text = String::new();
    for i in 0..2 {
        let port = free_udp_port();
        text += &format!(
            "[[host]]\nname = \"s{i}\"\naddress = \"127.0.0.1\"\nport = {port}\ndevices = 1\nssh = \"ssh://root@127.0.0.1:{}\"\n\n",
            sshd.port
        );
        if i == 0 {
            text += &format!("binary = \"{}\"\n\n", env!("CARGO_BIN_EXE_legion-rs"));
        }
    }
    let hosts = dir.path().join("hosts.toml");
    std::fs::write(&hosts, text).unwrap();
    let state = dir.path().join("state");
    let (hosts, state) = (hosts.to_str().unwrap(), state.to_str().unwrap());

    let up = legion_with_ssh(&ssh, &["up", hosts, "--state", state]);
    let table = String::from_utf8_lossy(&up.stdout).to_string();
    let guard = scopeguard(ssh.clone(), hosts.to_string(), state.to_string());
    assert!(
        up.status.success(),
        "up failed: {}",
        String::from_utf8_lossy(&up.stderr)
    );
    let pids: Vec<u32> = table
        .lines()
        .filter(|l| l.starts_with('s'))
        .map(|l| l.split_whitespace().nth(4).unwrap().parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "{table}");

    let model = ["--model", "lenet5", "--batch", "8", "--strategy", "data"];
    let init = dir.path().join("init.safetensors");
    init_checkpoint(&init, &model);
    let on_cluster = dir.path().join("cluster.safetensors");
    train_from(
        &["--cluster", hosts, "--state", state],
        &model,
        "3",
        &init,
        &on_cluster,
    );
    let single = dir.path().join("single.safetensors");
    train_from(&[], &model, "3", &init, &single);
    assert_same_tensors(&on_cluster, &single);

    ok(legion_with_ssh(&ssh, &["down", hosts, "--state", state]));
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids
        .iter()
        .any(|&p| legion_cluster::launch::process_exists(p))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in pids {
        assert!(
            !legion_cluster::launch::process_exists(p),
            "worker {p} still runs after down"
        );
    }
    drop(guard);

    // A host without the binary: `up` fails at once, naming the host and the path.
    let missing = dir.path().join("missing.toml");
    std::fs::write(
        &missing,
        format!(
            "[[host]]\nname = \"far\"\naddress = \"127.0.0.1\"\nport = {}\nssh = \"ssh://root@127.0.0.1:{}\"\nbinary = \"/nonexistent/legion-rs\"\n",
            free_udp_port(),
            sshd.port
        ),
    )
    .unwrap();
    let up = legion_with_ssh(&ssh, &["up", missing.to_str().unwrap(), "--state", state]);
    let stderr = String::from_utf8_lossy(&up.stderr);
    assert!(!up.status.success(), "up succeeded without a binary");
    assert!(
        stderr.contains("far") && stderr.contains("no legion-rs binary at /nonexistent/legion-rs"),
        "{stderr}"
    );
}

/// Runs `down` when dropped, so a failing assertion leaves no worker behind.
fn scopeguard(ssh: String, hosts: String, state: String) -> impl Drop {
    struct Down(String, String, String);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = legion_with_ssh(&self.0, &["down", &self.1, "--state", &self.2]);
        }
    }
    Down(ssh, hosts, state)
}
