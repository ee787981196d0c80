//! Planning without training: a model's strategy searched (or several searches side by side) on
//! a machine, reported as `legion-rs plan` prints it ([`PlanReport`]'s `Display`) or as its
//! `--json` document.
//!
//! ```no_run
//! use legion::planning::Planning;
//! use legion::{SearchKind, ZooConfig};
//!
//! let size = ZooConfig { batch: 64, image_size: 224, channels: 3, classes: 1000 };
//! let machine = legion::planner::machine_file::resolve_machine("paper:4")?;
//! let report = Planning::new(legion::zoo("vgg16", size)?, machine)
//!     .search(SearchKind::OptCnn)
//!     .run()?;
//! println!("{report}");
//! # anyhow::Ok(())
//! ```
//!
//! `report.rs`: the tables and the JSON document, presentation kept out of the planner.

pub mod report;

use crate::job::Reported;
use anyhow::{Context, bail};
use legion_ops::Graph;
use legion_planner::config::config_counts;
use legion_planner::plan::{self, Evaluated, PlanRun};
use legion_planner::progress::Progress;
use legion_planner::search::{
    DEFAULT_BUDGET, DEFAULT_REFINE_SEED, RefineOptions, SIDE_BY_SIDE_BUDGET, SearchError,
    SearchOptions,
};
use legion_planner::simulate::SyncSimulation;
use legion_planner::{
    CostModel, CostProvider, MachineModel, ProfileDb, ProfiledCost, RooflineCost, SearchKind,
    SearchSpace, Strategy,
};
use report::PlanJson;
use std::fmt::Write;
use std::sync::Arc;

/// Which searches a plan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Searches {
    One(SearchKind),
    /// Every search of [`SearchKind::every`], side by side.
    All,
}

impl Searches {
    pub fn kinds(self) -> Vec<SearchKind> {
        match self {
            Searches::One(kind) => vec![kind],
            Searches::All => SearchKind::every().collect(),
        }
    }

    /// The exhaustive search's budget when none is given: with every search side by side, a small
    /// one, so that the table comes back in seconds.
    pub fn default_budget(self) -> u64 {
        match self {
            Searches::All => SIDE_BY_SIDE_BUDGET,
            Searches::One(_) => DEFAULT_BUDGET,
        }
    }
}

impl From<SearchKind> for Searches {
    fn from(kind: SearchKind) -> Searches {
        Searches::One(kind)
    }
}

impl std::str::FromStr for Searches {
    type Err = String;

    /// A search's name, or `all`.
    fn from_str(name: &str) -> Result<Searches, String> {
        if name == "all" {
            return Ok(Searches::All);
        }
        SearchKind::parse(name).map(Searches::One).ok_or_else(|| {
            let names: Vec<&str> = SearchKind::every().map(|k| k.name()).collect();
            format!(
                "unknown search '{name}': the searches are {}, or all",
                names.join(", ")
            )
        })
    }
}

/// A plan to search, built up option by option.
#[must_use = "a Planning does nothing until it is run"]
pub struct Planning {
    graph: Graph,
    machine: MachineModel,
    searches: Searches,
    profile: Option<(ProfileDb, String)>,
    budget: Option<u64>,
    refine_budget: Option<u64>,
    refine_seed: u64,
    space: SearchSpace,
    sync_simulation: SyncSimulation,
    progress: Reported<dyn Progress>,
}

impl Planning {
    /// Plans `graph` (its input's N is the global batch) on `machine` with OptCNN's search,
    /// pricing tiles by the roofline model.
    pub fn new(graph: Graph, machine: MachineModel) -> Planning {
        Planning {
            graph,
            machine,
            searches: Searches::One(SearchKind::OptCnn),
            profile: None,
            budget: None,
            refine_budget: None,
            refine_seed: DEFAULT_REFINE_SEED,
            space: SearchSpace::WithReductions,
            sync_simulation: SyncSimulation::Auto,
            progress: Reported::default(),
        }
    }

    /// One search, or all of them side by side.
    pub fn search(mut self, searches: impl Into<Searches>) -> Self {
        self.searches = searches.into();
        self
    }

    /// Prices tiles as this profile (from `source`, said in the report) measured them; the
    /// roofline model prices what it lacks.
    pub fn profile(mut self, db: ProfileDb, source: impl Into<String>) -> Self {
        self.profile = Some((db, source.into()));
        self
    }

    /// Most partial strategies the exhaustive search may try.
    pub fn budget(mut self, budget: u64) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Most simulations the refine search may run.
    pub fn refine_budget(mut self, budget: u64) -> Self {
        self.refine_budget = Some(budget);
        self
    }

    pub fn refine_seed(mut self, seed: u64) -> Self {
        self.refine_seed = seed;
        self
    }

    /// The paper's space only: no splits over input channels.
    pub fn paper_space(mut self) -> Self {
        self.space = SearchSpace::Paper;
        self
    }

    /// How the simulated step schedules parameter synchronisation.
    pub fn sync_simulation(mut self, sync: SyncSimulation) -> Self {
        self.sync_simulation = sync;
        self
    }

    /// Reports the searches' phases to `progress`.
    pub fn progress(mut self, progress: Arc<dyn Progress>) -> Self {
        self.progress = Reported::to(progress);
        self
    }

    /// The lines said before the search starts: what is planned where, and how tiles are priced.
    pub fn header(&self) -> String {
        let mut out = format!(
            "{} on {}, batch {}\n",
            self.graph.name,
            self.machine,
            self.graph.batch()
        );
        match &self.profile {
            Some((_, source)) => {
                let _ = writeln!(out, "t_c: measured kernel times from {source}");
            }
            None => out.push_str(
                "t_c: the roofline model (peak FLOP/s and memory bandwidth), not measured kernel \
                 times: --profile FILE prices tiles as a profile measured them\n",
            ),
        }
        out
    }

    /// Runs the searches; an error where the one search asked for fails, or every search does.
    pub fn run(self) -> anyhow::Result<PlanReport> {
        let header = self.header();
        let profiled = self
            .profile
            .as_ref()
            .map(|(db, _)| ProfiledCost::new(db, &self.machine));
        let roofline = RooflineCost::new(&self.machine);
        let provider: &dyn CostProvider = match &profiled {
            Some(p) => p,
            None => &roofline,
        };
        let mut model = CostModel::new(&self.graph, &self.machine, provider)
            .with_sync_simulation(self.sync_simulation);
        if let Some(progress) = self.progress.get() {
            model = model.with_progress(progress);
        }
        let budget = self.budget.unwrap_or(self.searches.default_budget());
        let options = SearchOptions {
            exhaustive_budget: budget,
            refine: RefineOptions {
                seed: self.refine_seed,
                ..match self.refine_budget {
                    Some(budget) => RefineOptions {
                        budget,
                        work: None,
                        ..RefineOptions::default()
                    },
                    None => RefineOptions::default(),
                }
            },
            space: self.space,
        };
        let run = plan::plan(&model, &self.searches.kinds(), &options);
        if self.searches != Searches::All
            && let Some(Err(e)) = run.searches.first().map(|s| &s.result)
        {
            bail!("{} search: {e}", run.searches[0].kind);
        }
        let best = run
            .best_index()
            .with_context(|| no_search_succeeded(&run))?;
        let stopped_at_budget = self.budget.is_none()
            && run.searches.iter().any(|s| {
                s.kind == SearchKind::Exhaustive
                    && matches!(s.result, Err(SearchError::BudgetExceeded { .. }))
            });
        let priced = profiled
            .as_ref()
            .map(|p| (p.hits(), p.scaled(), p.misses()));
        let counts = config_counts(&self.graph, self.machine.num_devices(), self.space);
        Ok(PlanReport {
            t_c: match &self.profile {
                Some((_, source)) => format!("profile {source}"),
                None => "roofline".into(),
            },
            header,
            budget: stopped_at_budget.then_some(budget),
            searches: self.searches,
            counts,
            run,
            best,
            priced,
            graph: self.graph,
            machine: self.machine,
        })
    }
}

/// Why every search of `run` failed, one search a line.
fn no_search_succeeded(run: &PlanRun) -> String {
    let mut why = String::from("no search succeeded:");
    for s in &run.searches {
        if let Err(e) = &s.result {
            why.push_str(&format!("\n  {}: {e}", s.kind.name()));
        }
    }
    why
}

/// The searches' outcome: each search's strategy (or why it failed) and the best of them.
pub struct PlanReport {
    pub graph: Graph,
    pub machine: MachineModel,
    pub run: PlanRun,
    /// The index in `run.searches` of the cheapest strategy under Eq. 1.
    pub best: usize,
    searches: Searches,
    header: String,
    t_c: String,
    counts: Vec<usize>,
    /// The exhaustive search's default budget, where it stopped at it beside the others.
    budget: Option<u64>,
    /// Tiles a profile priced: measured, scaled from a measured tile of their op, by roofline.
    pub priced: Option<(u64, u64, u64)>,
}

impl PlanReport {
    /// The best strategy, evaluated.
    pub fn chosen(&self) -> &Evaluated {
        self.run.searches[self.best]
            .result
            .as_ref()
            .expect("the best search succeeded")
    }

    /// The search that found the best strategy.
    pub fn chosen_search(&self) -> SearchKind {
        self.run.searches[self.best].kind
    }

    /// The best strategy as a strategy file holds it.
    pub fn strategy(&self) -> Strategy {
        Strategy::from_configs(&self.graph, &self.chosen().configs)
    }

    /// The `--json` document.
    pub fn json(&self) -> PlanJson {
        PlanJson::of(
            &self.graph,
            &self.run,
            self.t_c.clone(),
            self.machine.precision(),
        )
    }

    /// What `legion-rs plan` prints after [`Planning::header`]: the searches side by side (where
    /// there were several), the best one's summary and its per-layer table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let best = &self.run.searches[self.best];
        let chosen = self.chosen();
        if self.searches == Searches::All {
            out.push_str(&report::comparison_table(&self.run));
            if let Some(budget) = self.budget {
                let _ = writeln!(
                    out,
                    "exhaustive stopped at {budget} partial strategies, its budget beside the \
                     other searches; --budget N lets it try more (--search exhaustive: \
                     {DEFAULT_BUDGET})"
                );
            }
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "{}",
            report::summary(best.kind.name(), chosen, Some(best.seconds))
        );
        if self.searches != Searches::All
            && let Some(refined) = &best.refined
        {
            let _ = writeln!(out, "{}", report::refine_line(refined));
        }
        for s in &self.run.searches {
            if let (Some(o), Ok(e)) = (&s.optimality, &s.result)
                && let Some(line) = report::optimality_line(&self.graph, o, e.cost.total)
            {
                let _ = writeln!(out, "{line}");
            }
        }
        out.push_str(&report::layer_table(
            &self.graph,
            &self.counts,
            &chosen.configs,
            &chosen.cost,
        ));
        out
    }
}

/// The header, then the table: all that `legion-rs plan` prints on stdout.
impl std::fmt::Display for PlanReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.header, self.table())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::zoo::ZooConfig;

    fn lenet(batch: usize) -> Graph {
        let size = ZooConfig {
            batch,
            image_size: 28,
            channels: 1,
            classes: 10,
        };
        crate::zoo("lenet5", size).unwrap()
    }

    #[test]
    fn a_plan_reports_its_choice_as_the_table_and_the_document_say() {
        let machine = legion_planner::machine_file::resolve_machine("paper:4").unwrap();
        let report = Planning::new(lenet(64), machine)
            .search(SearchKind::OptCnn)
            .run()
            .unwrap();
        assert_eq!(report.chosen_search(), SearchKind::OptCnn);
        let text = report.to_string();
        assert!(text.starts_with("lenet5 on "), "{text}");
        assert!(text.contains("optcnn: Eq.1 "), "{text}");
        for layer in report.graph.layers() {
            assert!(text.contains(&layer.name), "{} not in\n{text}", layer.name);
        }
        let doc: serde_json::Value = serde_json::to_value(report.json()).unwrap();
        let search = &doc["searches"][0];
        assert_eq!(search["search"], "optcnn");
        let eq1 = search["eq1_ms"].as_f64().unwrap();
        assert!((eq1 - report.chosen().cost.total * 1e3).abs() < 1e-9);
        assert_eq!(
            search["strategy"].as_array().unwrap().len(),
            report.graph.layers().len()
        );
    }

    #[test]
    fn all_searches_side_by_side_name_the_cheapest_and_unknown_names_are_refused() {
        let machine = legion_planner::machine_file::resolve_machine("paper:2").unwrap();
        let report = Planning::new(lenet(16), machine)
            .search(Searches::All)
            .run()
            .unwrap();
        let cheapest = report
            .run
            .searches
            .iter()
            .filter_map(|s| s.result.as_ref().ok())
            .map(|e| e.cost.total)
            .fold(f64::INFINITY, f64::min);
        assert_eq!(report.chosen().cost.total, cheapest);
        assert!(report.table().contains("search "), "{}", report.table());
        let e = "bogus".parse::<Searches>().unwrap_err();
        assert!(e.contains("optcnn") && e.contains("all"), "{e}");
        assert_eq!(
            "data".parse::<Searches>(),
            Ok(Searches::One(SearchKind::Data))
        );
    }
}
