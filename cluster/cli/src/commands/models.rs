use clap::Args;
use legion_ops::zoo;
use serde::Serialize;

#[derive(Args, Debug)]
pub struct ModelsArgs {
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct ModelInfo {
    name: &'static str,
    image_size: usize,
    channels: usize,
    classes: usize,
    layers: usize,
    params: u64,
    /// Forward FLOPs of one sample at the default size.
    forward_flops: u64,
    /// Forward + backward FLOPs of one sample.
    train_flops: u64,
}

pub fn run(args: ModelsArgs) -> anyhow::Result<()> {
    let infos: Vec<ModelInfo> = zoo::MODELS
        .iter()
        .map(|m| {
            let cfg = m.default_config(1);
            let g = m.build(&cfg)?;
            let f = g.flops();
            Ok(ModelInfo {
                name: m.name,
                image_size: cfg.image_size,
                channels: cfg.channels,
                classes: cfg.classes,
                layers: g.layers().len(),
                params: g.param_count(),
                forward_flops: f.forward,
                train_flops: f.forward + f.backward,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    if args.json {
        for i in &infos {
            println!("{}", serde_json::to_string(i)?);
        }
        return Ok(());
    }
    // as wide as the longest name, so that every column lines up whatever the zoo holds
    let width = infos.iter().map(|i| i.name.len()).max().unwrap_or(0).max(5);
    println!(
        "{:<width$} {:>7} {:>7} {:>15} {:>12} {:>12}",
        "model", "input", "layers", "params", "fwd FLOPs", "train FLOPs"
    );
    for i in &infos {
        println!(
            "{:<width$} {:>7} {:>7} {:>15} {:>12} {:>12}",
            i.name,
            format!("{}x{}", i.image_size, i.image_size),
            i.layers,
            group_thousands(i.params),
            si(i.forward_flops),
            si(i.train_flops)
        );
    }
    println!("(FLOPs per sample at the default input size)");
    Ok(())
}

/// `1.43 G`, `846.3 M`: FLOP counts span six orders of magnitude across the zoo.
fn si(n: u64) -> String {
    let x = n as f64;
    match x {
        x if x >= 1e9 => format!("{:.2} G", x / 1e9),
        x if x >= 1e6 => format!("{:.1} M", x / 1e6),
        x => format!("{:.1} k", x / 1e3),
    }
}

fn group_thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}
