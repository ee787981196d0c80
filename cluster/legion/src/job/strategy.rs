//! What a job runs on several devices: a search's configs, or a strategy file's, checked against
//! the model and the devices.

use anyhow::{Context, bail};
use legion_ops::Graph;
use legion_planner::progress::Progress;
use legion_planner::search::{self, SearchKind};
use legion_planner::{
    CostModel, CostProvider, CostTables, MachineModel, ParallelConfig, ProfileDb, ProfiledCost,
    RooflineCost, SearchSpace, Strategy as StrategyFile,
};
use std::path::{Path, PathBuf};

/// How a job parallelises each layer over its devices.
#[derive(Clone, Debug, PartialEq)]
pub enum Strategy {
    /// The configs a search finds on the run's machine, priced as the run's [`crate::costs::Costs`]
    /// say.
    Search(SearchKind),
    /// A strategy JSON file (as `legion-rs plan --out` writes).
    File(PathBuf),
}

impl Default for Strategy {
    fn default() -> Strategy {
        Strategy::Search(SearchKind::OptCnn)
    }
}

impl From<SearchKind> for Strategy {
    fn from(kind: SearchKind) -> Strategy {
        Strategy::Search(kind)
    }
}

/// The command line's form: a search's name, else the path of a strategy file.
impl From<&str> for Strategy {
    fn from(choice: &str) -> Strategy {
        match SearchKind::parse(choice) {
            Some(kind) => Strategy::Search(kind),
            None => Strategy::File(choice.into()),
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = std::convert::Infallible;

    fn from_str(choice: &str) -> Result<Strategy, Self::Err> {
        Ok(Strategy::from(choice))
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Strategy::Search(kind) => f.write_str(kind.name()),
            Strategy::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Every name `--strategy` (and `profile --strategies`, `--compare --strategies`) accepts for a
/// search, in the order help and errors list them: the searches of our space, then the other
/// papers' planners. Parsing, help and errors all use this list.
pub fn strategy_names() -> Vec<&'static str> {
    SearchKind::every().map(SearchKind::name).collect()
}

/// The configs of `choice` for `graph` on `machine`.
pub fn choose_strategy(
    graph: &Graph,
    machine: &MachineModel,
    choice: &Strategy,
) -> anyhow::Result<Vec<ParallelConfig>> {
    choose_strategy_for("--strategy", graph, machine, choice)
}

/// [`choose_strategy`] for a choice given by the command-line option `flag`, which errors name.
pub fn choose_strategy_for(
    flag: &str,
    graph: &Graph,
    machine: &MachineModel,
    choice: &Strategy,
) -> anyhow::Result<Vec<ParallelConfig>> {
    choose_strategy_reporting(flag, graph, machine, choice, None)
}

/// [`choose_strategy_for`], a search reporting its phases to `progress`.
pub fn choose_strategy_reporting(
    flag: &str,
    graph: &Graph,
    machine: &MachineModel,
    choice: &Strategy,
    progress: Option<&dyn Progress>,
) -> anyhow::Result<Vec<ParallelConfig>> {
    Ok(choose_strategy_ranked(flag, graph, machine, choice, None, progress, 0)?.configs)
}

/// What [`choose_strategy_ranked`] chose.
pub struct Chosen {
    pub configs: Vec<ParallelConfig>,
    /// The search's lookups: measured, scaled from a measured tile of their op, by roofline.
    pub priced: Option<(u64, u64, u64)>,
    /// The chosen strategy first, then the alternatives a run may verify it against
    /// ([`super::verify::candidates`]); empty for a strategy file.
    pub candidates: Vec<super::verify::Candidate>,
}

/// [`choose_strategy_reporting`], a search pricing tiles as `measured` has them (the roofline
/// what it lacks; all of them without it), with the lookups it made and up to `alternatives`
/// other strategies ranked beside its own, priced by the same tables.
pub fn choose_strategy_ranked(
    flag: &str,
    graph: &Graph,
    machine: &MachineModel,
    choice: &Strategy,
    measured: Option<&ProfileDb>,
    progress: Option<&dyn Progress>,
    alternatives: usize,
) -> anyhow::Result<Chosen> {
    match choice {
        Strategy::Search(kind) => {
            let profiled = measured.map(|db| ProfiledCost::new(db, machine));
            let roofline = RooflineCost::new(machine);
            let provider: &dyn CostProvider = match &profiled {
                Some(p) => p,
                None => &roofline,
            };
            let cost = CostModel::new(graph, machine, provider);
            let cost = match progress {
                Some(progress) => cost.with_progress(progress),
                None => cost,
            };
            // the space `plan` searches by default: reduction splits included
            let tables = CostTables::build_in(&cost, SearchSpace::WithReductions);
            let configs = search::find(*kind, &tables, search::DEFAULT_BUDGET)
                .with_context(|| format!("{flag} {choice}"))?
                .configs;
            let priced = profiled
                .as_ref()
                .map(|p| (p.hits(), p.scaled(), p.misses()));
            let candidates = super::verify::candidates(&tables, (*kind, &configs), alternatives);
            Ok(Chosen {
                configs,
                priced,
                candidates,
            })
        }
        Strategy::File(path) => Ok(Chosen {
            configs: strategy_file_configs(flag, graph, machine.num_devices(), path)?,
            priced: None,
            candidates: Vec::new(),
        }),
    }
}

/// The configs of the strategy file `choice` for `graph` on `devices` devices, checked against
/// the model it was made for, the devices it places layers on and the batch its sample splits
/// need, each error naming the file and the flag to change.
pub(super) fn strategy_file_configs(
    flag: &str,
    graph: &Graph,
    devices: usize,
    path: &Path,
) -> anyhow::Result<Vec<ParallelConfig>> {
    let choice = path.display();
    if !path.exists() {
        bail!(
            "{flag} '{choice}' is neither a search ({}) nor an existing strategy file",
            strategy_names().join(", ")
        );
    }
    let strategy = StrategyFile::load(path)?;
    if let Some(made_for) = &strategy.model
        && made_for != &graph.name
    {
        bail!(
            "{flag} {choice}: the strategy was made for model '{made_for}', but --model is '{}' \
             (plan one for it: `legion-rs plan --model {} ... --out FILE`)",
            graph.name,
            graph.name
        );
    }
    strategy.to_configs(graph, devices).map_err(|e| {
        let needs = strategy
            .layers
            .iter()
            .flat_map(|l| l.devices.iter().map(|&d| d.saturating_add(1)))
            .max()
            .unwrap_or(1);
        let batch = graph.batch();
        let short_batch = strategy.layers.iter().find_map(|l| {
            let degree = l.degrees.get("n").copied().unwrap_or(1);
            (degree > batch).then_some((l.layer.as_str(), degree))
        });
        // What to change, where the flags can fix it: a device count the planner could run, or a
        // batch the sample splits divide.
        let fix = match short_batch {
            _ if needs > devices && needs <= legion_cluster::hosts::MAX_DEVICES => {
                format!("; it places layers on {needs} devices: give --devices {needs}")
            }
            Some((layer, degree)) if degree <= devices => format!(
                "; layer '{layer}' splits the batch (--batch {batch}) {degree} ways: give --batch \
                 {degree} or more"
            ),
            _ => String::new(),
        };
        anyhow::anyhow!(
            "{flag} {choice} (for model '{}' on {devices} device(s)): {e}{fix}",
            graph.name
        )
    })
}
