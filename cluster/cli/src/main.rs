use clap::Parser;
use legion_cli::{Cli, run};

fn main() {
    legion_cli::exit_quietly_on_broken_pipe();
    // Warnings and errors the runtime and transport log (a refused peer, a malformed frame that
    // closed its connection, a dropped slice) go to stderr, which is the log file of a worker
    // that `up` started. `RUST_LOG` (e.g. `legion_cluster=debug`) shows more.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, skipping causes whose text the message already includes
/// (many error types print their source themselves).
fn error_chain(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}
