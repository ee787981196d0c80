use clap::Parser;
use legion_cluster::cli::{Cli, run};

fn main() {
    legion_cluster::exit_quietly_on_broken_pipe();
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
