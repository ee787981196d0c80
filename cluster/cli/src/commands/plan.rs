//! `legion-rs plan`: find (or evaluate) a parallelization strategy for a model on a machine and
//! report its Eq. 1 cost, simulated step time and per-layer configs. The searches and the report
//! live in `legion::planning`; this file parses arguments and does the file I/O.

use crate::progress::PlanProgress;
use anyhow::{Context, bail};
use clap::{ArgGroup, Args, ValueEnum};
use legion::costs::{CostCache, Costs};
use legion::job::check_output_path;
use legion::planning::report::{self, PlanJson, SearchJson};
use legion::planning::{Planning, Searches};
use legion_cluster::memory::human_bytes;
use legion_ops::{Graph, Precision};
use legion_planner::config::config_counts;
use legion_planner::machine_file::resolve_machine;
use legion_planner::memory;
use legion_planner::plan::{self, Evaluated};
use legion_planner::search::DEFAULT_REFINE_SEED;
use legion_planner::simulate::{SyncSimulation, simulate};
use legion_planner::trace::chrome_trace;
use legion_planner::{
    CostModel, CostProvider, MachineModel, ParallelConfig, ProfileDb, ProfiledCost, RooflineCost,
    SearchKind, SearchSpace, Strategy,
};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("machine_source").required(true).args(["machine", "nodes", "cluster"])))]
pub struct PlanArgs {
    /// Zoo model name, model JSON file or ONNX file.
    #[arg(long)]
    model: String,
    /// Global batch size (default: 32 per device, the paper's per-GPU batch).
    #[arg(long)]
    batch: Option<usize>,
    /// Image size of a zoo model (default: the model's own).
    #[arg(long)]
    image_size: Option<usize>,
    /// Number of classes for zoo models (default: the model's own).
    #[arg(long)]
    classes: Option<usize>,
    /// Machine preset (paper and paper:N for N = 1, 2, 4, 8, 16: the paper's testbed with one
    /// shared NIC per node; paper-pairs:N: a link per GPU pair instead; dgx-h100, dgx-h100:N;
    /// local-cpu, local-cpu:N) or machine TOML file.
    #[arg(long, conflicts_with = "nodes")]
    machine: Option<String>,
    /// The machine of a hosts file's workers, as `train --cluster` plans for it: with the links
    /// `legion-rs up` measured (in --state, or where `up` keeps its state by default) where it
    /// ran. Worker processes sharing this machine's GPU (local hosts, `device = "cuda"`) are GPU
    /// devices on one GPU, one kernel at a time, whose slices to another process are staged out of
    /// and into device memory around the network (the staging --profile measured, else 25 GB/s
    /// each way); --profile then gives their tiles and GPU kind, not its links.
    #[arg(long, conflicts_with_all = ["machine", "nodes"], value_name = "HOSTS")]
    cluster: Option<PathBuf>,
    /// The state directory of --cluster (as `up` was given it).
    #[arg(long, requires = "cluster")]
    state: Option<PathBuf>,
    /// Memory of each device, GiB, instead of the machine's (P100s: 16): every search returns only
    /// strategies that fit it, and says so when it finds none.
    #[arg(long)]
    memory_gib: Option<f64>,
    /// Number of nodes of a machine described by flags.
    #[arg(long, requires = "devices_per_node")]
    nodes: Option<usize>,
    /// Devices per node of a machine described by flags.
    #[arg(long, requires = "nodes")]
    devices_per_node: Option<usize>,
    /// Bandwidth between devices of one node, Gbit/s (default 160, NVLink-class).
    #[arg(long, requires = "nodes")]
    intra_gbps: Option<f64>,
    /// Bandwidth between nodes, Gbit/s (default 100, EDR InfiniBand).
    #[arg(long, requires = "nodes")]
    inter_gbps: Option<f64>,
    /// The search to run, or all of them side by side.
    #[arg(long, value_enum, default_value_t = SearchChoice::One(SearchKind::OptCnn))]
    search: SearchChoice,
    /// A strategy file to evaluate (with --evaluate) instead of searching.
    #[arg(long, requires = "evaluate")]
    strategy: Option<PathBuf>,
    /// Evaluate the --strategy file: Eq. 1 and simulated step, per layer.
    #[arg(long, requires = "strategy")]
    evaluate: bool,
    /// Write the chosen strategy (the cheapest under Eq. 1 with --search all; --search refine for
    /// the fastest in simulation) to this JSON file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the chosen strategy's simulated iteration as Chrome/Perfetto trace JSON.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print one JSON document instead of tables.
    #[arg(long)]
    json: bool,
    /// What tiles are priced with: `roofline`, `measured` (the cost cache that `train` and
    /// `profile` keep of this machine's embedded devices: give --machine local-cpu:N), or a
    /// profile file (as `legion-rs profile --out` writes; also `--profile FILE`). Measured costs
    /// price what they hold, the roofline what is missing; their measured links, if any,
    /// replace every link of the machine.
    #[arg(long, alias = "profile", default_value = "roofline", value_parser = crate::flags::parse_costs)]
    costs: Costs,
    /// Most partial strategies the exhaustive search may try [default: 50000000, or 100000 with
    /// --search all, where the exhaustive search then stops early and says so].
    #[arg(long)]
    budget: Option<u64>,
    /// Most simulations the refine search may run, its starts included (a number, not seconds,
    /// so that a seed gives the same strategy on any machine) [default: 1500, fewer where a
    /// step has so many tasks that they would take more than about a minute; given, exactly it].
    #[arg(long)]
    refine_budget: Option<u64>,
    /// Seed of the refine search's visiting order and kicks.
    #[arg(long, default_value_t = DEFAULT_REFINE_SEED)]
    refine_seed: u64,
    /// Search the paper's space (degrees over samples, channels, height and width), as OptCNN
    /// did, to reproduce its numbers. Without it the searches also consider splitting conv2d and
    /// dense layers into partial sums over blocks of their input channels (`red`).
    #[arg(long)]
    paper_space: bool,
    /// What the devices compute in, as `train --precision` runs it: activations and their
    /// gradients take 2 bytes in bf16 (t_x, memory, the roofline's memory traffic), parameter
    /// sync stays fp32, a GPU's peak is its tensor cores' (TF32 or BF16; a P100's and a CPU's stay
    /// FP32), and devices are looked up in a --profile under their kind with the precision's
    /// suffix (`h100-bf16`, as `profile --precision bf16` stores them).
    #[arg(long, value_name = "fp32|tf32|bf16", default_value_t = Precision::Fp32)]
    precision: Precision,
    /// How the simulated step schedules parameter synchronisation: per-message (one task per
    /// message, the reference), collective (one task per lane and phase of each replicated slice,
    /// within 3% of
    /// per-message on the zoo on machines with a link per device pair or one NIC per node, up to
    /// ~20% on `dgx-h100`'s shared NIC rails, and far cheaper on hundreds of devices), or auto
    /// (per-message up to 64 devices, collective above).
    #[arg(long, value_parser = parse_sync_simulation, default_value = "auto")]
    sync_sim: SyncSimulation,
}

/// `--sync-sim`'s value, with the names it takes in the error.
fn parse_sync_simulation(name: &str) -> Result<SyncSimulation, String> {
    SyncSimulation::parse(name)
}

/// `--search`: one search of [`SearchKind::every`], or all of them side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SearchChoice {
    One(SearchKind),
    All,
}

impl ValueEnum for SearchChoice {
    fn value_variants<'a>() -> &'a [Self] {
        static VARIANTS: std::sync::LazyLock<Vec<SearchChoice>> = std::sync::LazyLock::new(|| {
            SearchKind::every()
                .map(SearchChoice::One)
                .chain([SearchChoice::All])
                .collect()
        });
        &VARIANTS
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(match self {
            SearchChoice::One(kind) => {
                clap::builder::PossibleValue::new(kind.name()).help(kind.summary())
            }
            SearchChoice::All => {
                clap::builder::PossibleValue::new("all").help("All of the above side by side")
            }
        })
    }
}

impl From<SearchChoice> for Searches {
    fn from(choice: SearchChoice) -> Searches {
        match choice {
            SearchChoice::One(kind) => Searches::One(kind),
            SearchChoice::All => Searches::All,
        }
    }
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    for (flag, path) in [("--out", &args.out), ("--trace", &args.trace)] {
        if let Some(path) = path {
            check_output_path(flag, path)?;
        }
    }
    let priced = priced_by(&args)?;
    let (db, source) = match priced {
        Some((db, source)) => (Some(db), Some(source)),
        None => (None, None),
    };
    let cluster = match &args.cluster {
        Some(path) => {
            let located = legion_cluster::launch::locate(Some(path), args.state.as_deref())?;
            let hosts = located.load_hosts()?;
            let staged = db.as_ref().and_then(|db| db.staged).map(|l| l.link());
            let machine = legion::machine::cluster_machine_staged(&hosts, &located.state, staged)?;
            // A GPU profile's tiles price the GPU it ran on, whichever that is.
            let kind = db.as_ref().and_then(|db| db.only_device_kind());
            Some(match kind {
                Some(kind) if legion::machine::shares_one_gpu(&hosts) => {
                    machine.with_device_kind(kind)
                }
                _ => machine,
            })
        }
        None => None,
    };
    let machine = match (&args.machine, args.nodes, args.devices_per_node) {
        _ if cluster.is_some() => cluster.clone().expect("checked"),
        (Some(spec), _, _) => resolve_machine(spec)?,
        (None, Some(nodes), Some(per_node)) => {
            MachineModel::from_flags(nodes, per_node, args.intra_gbps, args.inter_gbps)?
        }
        _ => {
            bail!("give --machine PRESET|FILE, --cluster HOSTS, or --nodes and --devices-per-node")
        }
    };
    let machine = match args.memory_gib {
        Some(gib) => machine.with_device_memory_gib(gib)?,
        None => machine,
    };
    let machine = machine.with_precision(args.precision);
    let batch = args.batch.unwrap_or(32 * machine.num_devices());
    let graph = super::resolve_model(&args.model, batch, args.image_size, args.classes)?.graph;
    // The measured links and compute sharing replace the preset's guesses, so transfers and the
    // schedule are priced like the tiles are (a cluster's links are what `up` measured).
    let machine = match &db {
        Some(db) if cluster.is_none() => db.apply_to(machine),
        _ => machine,
    };
    let space = match args.paper_space {
        true => SearchSpace::Paper,
        false => SearchSpace::WithReductions,
    };
    let (chosen, priced) = if args.evaluate {
        let path = args.strategy.as_deref().expect("clap requires --strategy");
        let profiled = db.as_ref().map(|db| ProfiledCost::new(db, &machine));
        let roofline = RooflineCost::new(&machine);
        let provider: &dyn CostProvider = match &profiled {
            Some(p) => p,
            None => &roofline,
        };
        let model = CostModel::new(&graph, &machine, provider).with_sync_simulation(args.sync_sim);
        let configs = Strategy::load(path)?
            .to_configs(&graph, machine.num_devices())
            .with_context(|| format!("{}", path.display()))?;
        let evaluated = plan::evaluate(&model, configs);
        if args.json {
            let doc = PlanJson {
                model: graph.name.clone(),
                devices: machine.num_devices(),
                precision: args.precision,
                t_c: t_c_source(source.as_deref()),
                searches: vec![SearchJson::of(&graph, "strategy", Ok(&evaluated), 0.0)],
            };
            println!("{}", doc.to_json());
        } else {
            print!(
                "{}",
                planning_of(&args, &graph, &machine, db.clone(), source.as_deref()).header()
            );
            println!(
                "{}",
                report::summary(&path.display().to_string(), &evaluated, None)
            );
            let counts = config_counts(&graph, machine.num_devices(), space);
            print!(
                "{}",
                report::layer_table(&graph, &counts, &evaluated.configs, &evaluated.cost)
            );
        }
        if let Some(path) = &args.trace {
            write_trace(path, &model, &evaluated)?;
        }
        let priced = profiled.map(|p| (p.hits(), p.scaled(), p.misses()));
        (evaluated, priced)
    } else {
        let progress = std::sync::Arc::new(PlanProgress::new());
        let planning = planning_of(&args, &graph, &machine, db.clone(), source.as_deref())
            .progress(progress.clone());
        // Said at once: the search may take a while (its progress shows on stderr).
        if !args.json {
            print!("{}", planning.header());
        }
        let report = planning.run();
        progress.finish();
        let report = report?;
        if args.json {
            println!("{}", report.json().to_json());
        } else {
            print!("{}", report.table());
        }
        let mut report = report;
        let chosen = report
            .run
            .searches
            .swap_remove(report.best)
            .result
            .expect("best is a success");
        if let Some(path) = &args.trace {
            let profiled = db.as_ref().map(|db| ProfiledCost::new(db, &machine));
            let roofline = RooflineCost::new(&machine);
            let provider: &dyn CostProvider = match &profiled {
                Some(p) => p,
                None => &roofline,
            };
            let model =
                CostModel::new(&graph, &machine, provider).with_sync_simulation(args.sync_sim);
            write_trace(path, &model, &chosen)?;
        }
        (chosen, report.priced)
    };

    warn_about_memory(&graph, &machine, &chosen.configs);
    if let Some((hits, scaled, misses)) = priced {
        eprintln!(
            "profile: {hits} tile(s) measured, {scaled} scaled from a measured tile of their op, \
             {misses} priced by the roofline model"
        );
    }
    if let Some(l) = db.as_ref().and_then(|db| db.links.as_ref()) {
        eprintln!(
            "profile: every link priced as measured, {:.2} GB/s and {:.1} µs per message",
            l.bytes_per_s / 1e9,
            l.latency_s * 1e6
        );
    }
    if let Some(threads) = db.as_ref().and_then(|db| db.compute_threads) {
        eprintln!(
            "profile: the simulation runs at most {threads} compute task(s) at once, as measured"
        );
    }
    if let Some(path) = &args.out {
        Strategy::from_configs(&graph, &chosen.configs).save(path)?;
    }
    Ok(())
}

/// The plan the flags ask for.
fn planning_of(
    args: &PlanArgs,
    graph: &Graph,
    machine: &MachineModel,
    db: Option<ProfileDb>,
    source: Option<&str>,
) -> Planning {
    let mut planning = Planning::new(graph.clone(), machine.clone())
        .search(Searches::from(args.search))
        .refine_seed(args.refine_seed)
        .sync_simulation(args.sync_sim);
    if let (Some(db), Some(source)) = (db, source) {
        planning = planning.profile(db, source);
    }
    if let Some(budget) = args.budget {
        planning = planning.budget(budget);
    }
    if let Some(budget) = args.refine_budget {
        planning = planning.refine_budget(budget);
    }
    if args.paper_space {
        planning = planning.paper_space();
    }
    planning
}

/// Warns on stderr when the chosen strategy needs more memory than a device has (or, for devices
/// sharing this host's memory, than the host has available).
fn warn_about_memory(graph: &Graph, machine: &MachineModel, configs: &[ParallelConfig]) {
    let need = memory::per_device_at(graph, configs, machine.nodes(), machine.precision());
    let over = memory::over_capacity(machine, &need);
    let largest = |d: &memory::DeviceMemory| match d.largest_layer {
        Some((layer, bytes)) => format!(
            ", layer '{}' alone {}",
            graph.layer(layer).name,
            human_bytes(bytes)
        ),
        None => String::new(),
    };
    if let Some((worst, capacity)) = over.iter().max_by_key(|(d, _)| d.bytes) {
        eprintln!(
            "warning: {} of {} device(s) need more memory than their {}: device {} needs {}{}",
            over.len(),
            machine.num_devices(),
            human_bytes(*capacity),
            worst.device,
            human_bytes(worst.bytes),
            largest(worst)
        );
    }
    let shared: Vec<&memory::DeviceMemory> = need
        .iter()
        .filter(|d| machine.device(d.device).memory_bytes().is_none())
        .collect();
    let shared_bytes = shared.iter().map(|d| d.bytes).fold(0, u64::saturating_add);
    if let (Some(worst), Some(available)) = (
        shared.iter().max_by_key(|d| d.bytes),
        legion_cluster::memory::available(),
    ) && shared_bytes > available
    {
        eprintln!(
            "warning: the {} device(s) sharing this host's memory need {} together, but it has {} \
             available; device {} needs {}{}",
            shared.len(),
            human_bytes(shared_bytes),
            human_bytes(available),
            worst.device,
            human_bytes(worst.bytes),
            largest(worst)
        );
    }
}

/// Where t_c comes from, for `--json`.
fn t_c_source(source: Option<&str>) -> String {
    match source {
        Some(source) => format!("profile {source}"),
        None => "roofline".into(),
    }
}

/// The measured costs `--costs` prices with and where they come from: a profile file, or the
/// cost cache of `--machine local-cpu:N`'s devices.
fn priced_by(args: &PlanArgs) -> anyhow::Result<Option<(ProfileDb, String)>> {
    let embedded = args
        .machine
        .as_deref()
        .and_then(|m| m.strip_prefix("local-cpu:"))
        .and_then(|n| n.parse::<usize>().ok());
    legion::costs::for_plan(
        &args.costs,
        embedded,
        args.precision,
        CostCache::default_location().as_ref(),
    )
    .with_context(|| format!("--costs {}", args.costs))
}

/// Writes the simulated iteration of `evaluated` as a trace: simulated again with every task
/// named, which only a trace needs.
fn write_trace(path: &Path, model: &CostModel, evaluated: &Evaluated) -> anyhow::Result<()> {
    let simulation = simulate(model, &evaluated.configs);
    let trace = chrome_trace(&simulation, model.machine());
    std::fs::write(path, serde_json::to_string(&trace)?)
        .with_context(|| format!("writing trace {}", path.display()))
}
