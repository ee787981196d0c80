//! What a search prices a layer's tiles with: the roofline, a given profile file, or what the
//! run's own devices measure ([`Costs`]). Measured costs live in a persistent cache
//! ([`CostCache`]), one file per kind of device and what else decides a tile's time, so that a
//! run measures only the tiles no earlier run of that kind measured, and its training steps add
//! what they time.
//!
//! The choice and its report are here; the cache and the measuring are `legion_profile::cache`'s,
//! on real steps of the embedded devices or of each worker's own.

use anyhow::{Context, bail};
use legion_cluster::MeasuredCosts;
use legion_cluster::hosts::Hosts;
use legion_ops::{Graph, Precision};
use legion_planner::ProfileDb;
use legion_planner::progress::{Phase, Progress};
pub use legion_profile::cache::{CACHE_DIR_ENV, CacheKey, CacheRead, CostCache};
use std::fmt;
use std::path::{Path, PathBuf};

/// How a run's search prices tiles.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Costs {
    /// What the run's devices measure: tiles the cache lacks are timed on them before the
    /// search, and the cache prices the rest.
    #[default]
    Measured,
    /// Peak FLOP/s and memory bandwidth, nothing measured.
    Roofline,
    /// A profile file (as `legion-rs profile --out` writes).
    Profile(PathBuf),
}

impl std::str::FromStr for Costs {
    type Err = String;

    /// `measured`, `roofline`, or the path of an existing profile file.
    fn from_str(choice: &str) -> Result<Costs, String> {
        match choice {
            "measured" => Ok(Costs::Measured),
            "roofline" => Ok(Costs::Roofline),
            path if Path::new(path).is_file() => Ok(Costs::Profile(path.into())),
            other => Err(format!(
                "'{other}' is neither measured, roofline nor an existing profile file (as \
                 `legion-rs profile --out` writes)"
            )),
        }
    }
}

impl fmt::Display for Costs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Costs::Measured => f.write_str("measured"),
            Costs::Roofline => f.write_str("roofline"),
            Costs::Profile(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The measured costs a plan without training prices with, and where they come from (none: the
/// roofline): a profile file, or the cost cache of this machine's `embedded` CPU devices, refused
/// where the plan is not for them or the cache holds nothing for them yet.
pub fn for_plan(
    costs: &Costs,
    embedded: Option<usize>,
    precision: Precision,
    cache: Option<&CostCache>,
) -> anyhow::Result<Option<(ProfileDb, String)>> {
    match costs {
        Costs::Roofline => Ok(None),
        Costs::Profile(path) => Ok(Some((ProfileDb::load(path)?, path.display().to_string()))),
        Costs::Measured => {
            let devices = embedded.context(
                "measured costs are this machine's embedded devices' as the cost cache has them: \
                 plan for them (--machine local-cpu:N), or give a profile file for another machine",
            )?;
            let cache = cache.context(format!(
                "no cost cache folder to read measured costs from (set {CACHE_DIR_ENV} or HOME)"
            ))?;
            let key = CacheKey::cpu_devices(devices, precision);
            let read = cache.read(&key);
            if let Some(why) = read.refused {
                bail!("{why}");
            }
            if read.db.entries.is_empty() {
                bail!(
                    "the cost cache has nothing for {} yet (`legion-rs train --devices {devices}` \
                     or `legion-rs profile --devices {devices} --strategies space` measures it)",
                    key.describe()
                );
            }
            Ok(Some((read.db, cache.path(&key).display().to_string())))
        }
    }
}

/// What a run's search priced tiles with, said in its plan.
#[derive(Clone, Debug, PartialEq)]
pub struct CostReport {
    /// `measured`, `roofline` or the profile file.
    pub choice: String,
    /// What was measured before the search, where the run measured on this process's devices.
    pub measuring: Option<Measuring>,
    /// What each worker measured before the search, where the run measured on a cluster's
    /// workers (each its own devices; each tile priced by the median of theirs).
    pub workers: Vec<(String, Measuring)>,
    /// Lookups of the search: measured, scaled from a measured tile of the op, by roofline.
    pub priced: Option<(u64, u64, u64)>,
    /// Why tiles were priced by the roofline, where any were.
    pub roofline_because: Option<String>,
}

impl CostReport {
    /// The report once the search priced its tiles: `priced` its lookups (measured, scaled,
    /// roofline), and why any were priced by the roofline where the choice does not say.
    pub fn searched(mut self, priced: Option<(u64, u64, u64)>) -> CostReport {
        self.priced = priced;
        if self.roofline_because.is_none() && priced.is_some_and(|(_, _, misses)| misses > 0) {
            self.roofline_because = Some(
                "no tile of their op was measured (with their input channels, for an op that \
                 sums over them)"
                    .into(),
            );
        }
        self
    }
}

/// A run's measuring before its search.
#[derive(Clone, Debug, PartialEq)]
pub struct Measuring {
    /// Strategies whose steps were timed, of those the space needs.
    pub strategies_run: usize,
    pub strategies_in_space: usize,
    pub new_tiles: usize,
    pub seconds: f64,
    /// The cache file the costs are kept in (on a worker's host, for a worker's).
    pub cache: PathBuf,
}

impl fmt::Display for Measuring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.new_tiles {
            0 => write!(f, "every tile from {}", self.cache.display()),
            n => write!(
                f,
                "{n} new tile(s) timed in {:.1} s ({} of {} strategies' steps), kept in {}",
                self.seconds,
                self.strategies_run,
                self.strategies_in_space,
                self.cache.display()
            ),
        }
    }
}

impl fmt::Display for CostReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "costs: {}", self.choice)?;
        if let Some(m) = &self.measuring {
            write!(f, ", {m}")?;
        }
        if !self.workers.is_empty() {
            write!(f, " on {} worker(s) (", self.workers.len())?;
            for (i, (name, m)) in self.workers.iter().enumerate() {
                let sep = if i == 0 { "" } else { "; " };
                write!(f, "{sep}{name}: {m}")?;
            }
            write!(f, "), each tile the median of theirs")?;
        }
        if let Some((hits, scaled, misses)) = self.priced {
            write!(
                f,
                "; the search priced {hits} tile(s) as measured, {scaled} scaled from a \
                 measured tile of their op, {misses} by roofline"
            )?;
        }
        if let Some(why) = &self.roofline_because {
            write!(f, "; roofline because {why}")?;
        }
        Ok(())
    }
}

/// What prices a run's search: the costs to look tiles up in (none: the roofline) and what
/// the report says of them.
pub struct Pricing {
    pub db: Option<ProfileDb>,
    pub report: CostReport,
    /// Where the run's own steps add what they time: the cache and its key.
    pub cache: Option<(CostCache, CacheKey)>,
    /// A cache file refused (see [`CacheRead::refused`]), for a warning.
    pub refused: Option<String>,
}

/// Where a run's devices are, as far as measuring goes.
pub enum Devices<'a> {
    /// The embedded cluster's devices on this machine's CPU.
    EmbeddedCpu { devices: usize },
    /// A cluster's workers, each measuring on its own devices: the cluster whose state is in
    /// `state`.
    Workers { hosts: &'a Hosts, state: &'a Path },
    /// Devices this run does not measure on (GPUs): why not.
    Elsewhere { why: &'a str },
}

/// Why a cluster's workers do not measure their op costs, where they do not: GPU workers do not
/// yet, and a host declared as another device is priced as that device.
pub fn workers_unmeasured(hosts: &Hosts) -> Option<String> {
    let gpu = legion_cluster::hosts::GPU_KIND;
    if let Some(h) = hosts.hosts.iter().find(|h| h.device_kind == gpu) {
        return Some(format!(
            "host {} runs its devices on GPUs, whose workers do not measure op costs before a \
             search yet (`legion-rs profile --device cuda` on the host and --costs FILE price them)",
            h.name
        ));
    }
    hosts
        .hosts
        .iter()
        .find(|h| h.device_kind != "cpu")
        .map(|h| {
            format!(
                "host {} is declared a {} (device = \"{}\"), which the plan prices as that \
                 device, not as the cores its worker runs on",
                h.name, h.device_kind, h.device_kind
            )
        })
}

/// Measures what this host's cost cache lacks of `graph`'s tiles on `devices` of its cores, first
/// checking that each strategy it runs fits this host: what a cluster's worker answers a
/// driver's search with. The worker's environment ([`CACHE_DIR_ENV`] or HOME) says where it
/// keeps them.
pub fn measure_on_this_host(
    graph: &Graph,
    devices: usize,
    precision: Precision,
) -> anyhow::Result<MeasuredCosts> {
    let cache = CostCache::default_location().with_context(|| {
        format!("no folder to keep measured costs in (set {CACHE_DIR_ENV} or HOME for the worker)")
    })?;
    let key = CacheKey::cpu_devices(devices, precision);
    let fits = |configs: &[legion_planner::ParallelConfig]| {
        legion_cluster::memory::check_this_host(graph, Some((configs, devices)))
    };
    let measured =
        legion_profile::cache::measure_missing(graph, devices, &key, &cache, &fits, None)?;
    Ok(MeasuredCosts {
        profile_json: measured.db.to_json(),
        new_tiles: measured.new_tiles as u64,
        strategies_run: measured.strategies_run as u32,
        strategies_in_space: measured.strategies_in_space as u32,
        seconds: measured.seconds,
        cache: measured.cache.display().to_string(),
        refused: measured.refused,
    })
}

/// What a cluster's workers measured, together.
struct WorkersMeasured {
    /// Each tile's median over the workers.
    db: ProfileDb,
    /// Each worker's own measuring, by name.
    workers: Vec<(String, Measuring)>,
    /// The strategies a worker did not run, and why, each named by its worker.
    refused: Vec<String>,
}

/// Has every worker measure what its cache lacks; each tile is priced by the median of the
/// workers' costs.
fn measure_on_workers(
    graph: &Graph,
    hosts: &Hosts,
    state: &Path,
    precision: Precision,
    progress: Option<&dyn Progress>,
) -> anyhow::Result<WorkersMeasured> {
    let done = |finished: usize, workers: usize| {
        if let Some(p) = progress {
            p.update(Phase::Measuring, finished as u64, workers as u64);
        }
    };
    let answers =
        legion_cluster::measure::measure_costs(hosts, state, &graph.to_json(), precision, &done)
            .with_context(|| format!("measuring {}'s op costs on the workers", graph.name))?;
    let mut profiles = Vec::new();
    let mut workers = Vec::new();
    let mut refused = Vec::new();
    for (name, costs) in answers {
        profiles.push(ProfileDb::from_json(
            &costs.profile_json,
            &format!("worker {name}'s measured costs"),
        )?);
        refused.extend(costs.refused.map(|why| format!("worker {name}: {why}")));
        workers.push((
            name,
            Measuring {
                strategies_run: costs.strategies_run as usize,
                strategies_in_space: costs.strategies_in_space as usize,
                new_tiles: costs.new_tiles as usize,
                seconds: costs.seconds,
                cache: costs.cache.into(),
            },
        ));
    }
    Ok(WorkersMeasured {
        db: ProfileDb::median_of(&profiles),
        workers,
        refused,
    })
}

/// Prices `graph`'s tiles as `costs` asks, measuring on the devices what the cache lacks.
pub fn prepare(
    costs: &Costs,
    graph: &Graph,
    devices: Devices<'_>,
    precision: Precision,
    cache: Option<&CostCache>,
    progress: Option<&dyn Progress>,
) -> anyhow::Result<Pricing> {
    let mut report = CostReport {
        choice: costs.to_string(),
        measuring: None,
        workers: Vec::new(),
        priced: None,
        roofline_because: None,
    };
    let nothing = |report| Pricing {
        db: None,
        report,
        cache: None,
        refused: None,
    };
    match costs {
        Costs::Roofline => {
            report.roofline_because = Some("--costs roofline".into());
            Ok(nothing(report))
        }
        Costs::Profile(path) => Ok(Pricing {
            db: Some(ProfileDb::load(path).with_context(|| format!("--costs {}", path.display()))?),
            report,
            cache: None,
            refused: None,
        }),
        Costs::Measured => {
            let devices = match devices {
                Devices::EmbeddedCpu { devices } => devices,
                Devices::Workers { hosts, state } => {
                    if let Some(why) = workers_unmeasured(hosts) {
                        report.roofline_because = Some(why);
                        return Ok(nothing(report));
                    }
                    let WorkersMeasured {
                        db,
                        workers,
                        refused,
                    } = measure_on_workers(graph, hosts, state, precision, progress)?;
                    report.workers = workers;
                    return Ok(Pricing {
                        db: Some(db),
                        report,
                        cache: None,
                        refused: (!refused.is_empty()).then(|| refused.join("; ")),
                    });
                }
                Devices::Elsewhere { why } => {
                    report.roofline_because = Some(why.to_string());
                    return Ok(nothing(report));
                }
            };
            let Some(cache) = cache else {
                report.roofline_because = Some(format!(
                    "there is no folder to keep measured costs in (set {CACHE_DIR_ENV} or HOME)"
                ));
                return Ok(nothing(report));
            };
            let key = CacheKey::cpu_devices(devices, precision);
            // The runs that measure check that each strategy fits this host first.
            let fits = |configs: &[legion_planner::ParallelConfig]| {
                legion_cluster::memory::check_this_host(graph, Some((configs, devices)))
            };
            let measured = legion_profile::cache::measure_missing(
                graph, devices, &key, cache, &fits, progress,
            )?;
            report.measuring = Some(Measuring {
                strategies_run: measured.strategies_run,
                strategies_in_space: measured.strategies_in_space,
                new_tiles: measured.new_tiles,
                seconds: measured.seconds,
                cache: measured.cache,
            });
            Ok(Pricing {
                db: Some(measured.db),
                report,
                cache: Some((cache.clone(), key)),
                refused: measured.refused,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_choice_parses_and_names_what_it_takes() {
        assert_eq!("measured".parse::<Costs>(), Ok(Costs::Measured));
        assert_eq!("roofline".parse::<Costs>(), Ok(Costs::Roofline));
        let err = "no-such-profile.json".parse::<Costs>().unwrap_err();
        assert!(
            err.contains("neither measured, roofline nor an existing profile"),
            "{err}"
        );
        assert_eq!(Costs::default(), Costs::Measured);
    }

    #[test]
    fn workers_of_cores_measure_and_gpu_or_declared_hosts_say_why_not() {
        let hosts = |devices: [&str; 2]| {
            let text = format!(
                "[[host]]\nname = \"a\"\naddress = \"10.0.0.1\"\ndevice = \"{}\"\ndevices = 2\n\n\
                 [[host]]\nname = \"b\"\naddress = \"10.0.0.2\"\ndevice = \"{}\"\ndevices = 2\n",
                devices[0], devices[1]
            );
            Hosts::parse_toml(&text, "hosts.toml").unwrap()
        };
        assert_eq!(workers_unmeasured(&hosts(["cpu", "cpu"])), None);
        let gpu = workers_unmeasured(&hosts(["cpu", "cuda"])).unwrap();
        assert!(gpu.starts_with("host b runs its devices on GPUs"), "{gpu}");
        let declared = workers_unmeasured(&hosts(["p100", "cpu"])).unwrap();
        assert!(
            declared.starts_with("host a is declared a p100 (device = \"p100\")"),
            "{declared}"
        );
    }
}
