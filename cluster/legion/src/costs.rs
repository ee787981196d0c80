//! What a search prices a layer's tiles with: the roofline, a given profile file, or what the
//! run's own devices measure ([`Costs`]). Measured costs live in a persistent cache
//! ([`CostCache`]), one file per kind of device and what else decides a tile's time, so that a
//! run measures only the tiles no earlier run of that kind measured, and its training steps add
//! what they time.
//!
//! The pure part is here: the choice, the cache's files and the decision of what is left to
//! measure. The measuring is `legion_profile`'s, on real steps of the embedded devices.

use anyhow::{Context, bail};
use legion_ops::{Graph, Precision};
use legion_planner::profile::ProfileKey;
use legion_planner::progress::Progress;
use legion_planner::{ParallelConfig, ProfileDb};
use legion_profile::{ProfileSettings, space_strategies, tile_keys};
use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;

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

/// The environment variable that moves the cache (default: `$XDG_CACHE_HOME/legion-rs/costs`,
/// else `~/.cache/legion-rs/costs`).
pub const CACHE_DIR_ENV: &str = "LEGION_RS_COST_CACHE";

/// What a cache file's costs hold for: the device kind the planner names the devices by, the
/// precision they compute in, and where they ran (devices sharing this host's cores run each
/// kernel on their share of the threads, so the count is part of the cost).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    pub device_kind: String,
    pub precision: Precision,
    /// `2 cores shared by 4 devices`.
    pub host: String,
}

impl CacheKey {
    /// The embedded cluster's `devices` devices on this machine's cores.
    pub fn embedded_cpu(devices: usize, precision: Precision) -> CacheKey {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        CacheKey {
            device_kind: "cpu".into(),
            precision,
            host: format!("{cores} cores shared by {devices} devices"),
        }
    }

    /// What the cache file records it was measured on, and is refused for when it differs.
    pub fn describe(&self) -> String {
        format!(
            "{}, {}, {}",
            self.device_kind,
            self.precision.name(),
            self.host
        )
    }

    fn file_name(&self) -> String {
        let host: String = self
            .host
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        format!("{}-{}-{host}.json", self.device_kind, self.precision.name())
    }
}

/// The persistent cache of measured costs: a folder of profile files, one per [`CacheKey`],
/// each replaced atomically.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CostCache {
    dir: PathBuf,
}

/// A cache file as read: its costs, and why it was not used where it could not be.
#[derive(Debug, Default)]
pub struct CacheRead {
    pub db: ProfileDb,
    /// The file and what was wrong with it (unreadable, or measured on other devices): its
    /// costs are not used and the next write replaces it.
    pub refused: Option<String>,
}

impl CostCache {
    pub fn at(dir: impl Into<PathBuf>) -> CostCache {
        CostCache { dir: dir.into() }
    }

    /// `$LEGION_RS_COST_CACHE`, else the user's cache folder; `None` where there is no home.
    pub fn default_location() -> Option<CostCache> {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(dir) = var(CACHE_DIR_ENV) {
            return Some(CostCache::at(dir));
        }
        let base = var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
        Some(CostCache::at(base.join("legion-rs").join("costs")))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds `key`'s costs.
    pub fn path(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// `key`'s costs; empty where the file does not exist yet or is refused.
    pub fn read(&self, key: &CacheKey) -> CacheRead {
        let path = self.path(key);
        if !path.exists() {
            return CacheRead::default();
        }
        let refused = |why: String| CacheRead {
            db: ProfileDb::default(),
            refused: Some(format!(
                "{}: {why}; its costs are not used, and this run rewrites it",
                path.display()
            )),
        };
        let db = match ProfileDb::load(&path) {
            Ok(db) => db,
            Err(e) => return refused(e.to_string()),
        };
        let made_for = db.measured_on.as_ref().map(|m| m.device.as_str());
        if made_for != Some(key.describe().as_str()) {
            return refused(format!(
                "measured on {}, not on {}",
                made_for.unwrap_or("devices it does not name"),
                key.describe()
            ));
        }
        if let Some(e) = db.entries.iter().find(|e| e.device_kind != key.device_kind) {
            return refused(format!(
                "holds costs of device kind '{}', not '{}'",
                e.device_kind, key.device_kind
            ));
        }
        CacheRead { db, refused: None }
    }

    /// Adds `measured` to `key`'s file (an entry measured again replaces the old one; the
    /// transport and runtime fits are replaced where `measured` has them), written atomically;
    /// returns the file and what it now holds.
    pub fn add(
        &self,
        key: &CacheKey,
        measured: &ProfileDb,
    ) -> anyhow::Result<(PathBuf, ProfileDb)> {
        let path = self.path(key);
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating the cost cache {}", self.dir.display()))?;
        let mut kept = self.read(key).db;
        kept.insert_all(measured.entries.iter().cloned());
        kept.links = measured.links.or(kept.links);
        kept.compute_threads = measured.compute_threads.or(kept.compute_threads);
        kept.runtime = measured.runtime.or(kept.runtime);
        kept.measured_on = Some(legion_planner::profile::MeasuredOn {
            device: key.describe(),
            software: format!("legion-rs {}", env!("CARGO_PKG_VERSION")),
            date: String::new(),
            command: "measured by training runs and `legion-rs profile`".into(),
        });
        kept.save(&path)
            .with_context(|| format!("writing the cost cache {}", path.display()))?;
        Ok((path, kept))
    }
}

/// The strategies of `space` (every tile shape the searches may choose: [`space_strategies`])
/// whose steps would time tiles `known` lacks; each new tile is counted once.
pub fn left_to_measure(
    graph: &Graph,
    space: Vec<(String, Vec<ParallelConfig>)>,
    device_kind: &str,
    known: &HashSet<ProfileKey>,
) -> (Vec<(String, Vec<ParallelConfig>)>, usize) {
    let mut seen = known.clone();
    let mut new_tiles = 0;
    let strategies = space
        .into_iter()
        .filter(|(_, configs)| {
            let before = new_tiles;
            for key in tile_keys(graph, configs, device_kind) {
                if seen.insert(key) {
                    new_tiles += 1;
                }
            }
            new_tiles > before
        })
        .collect();
    (strategies, new_tiles)
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
            let key = CacheKey::embedded_cpu(devices, precision);
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
    /// What was measured before the search, where the run measured.
    pub measuring: Option<Measuring>,
    /// Lookups of the search: measured, scaled from a measured tile of the op, by roofline.
    pub priced: Option<(u64, u64, u64)>,
    /// Why tiles were priced by the roofline, where any were.
    pub roofline_because: Option<String>,
}

/// A run's measuring before its search.
#[derive(Clone, Debug, PartialEq)]
pub struct Measuring {
    /// Strategies whose steps were timed, of those the space needs.
    pub strategies_run: usize,
    pub strategies_in_space: usize,
    pub new_tiles: usize,
    pub seconds: f64,
    /// The cache file the costs are kept in.
    pub cache: PathBuf,
}

impl fmt::Display for CostReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "costs: {}", self.choice)?;
        if let Some(m) = &self.measuring {
            match m.new_tiles {
                0 => write!(f, ", every tile from {}", m.cache.display())?,
                n => write!(
                    f,
                    ", {n} new tile(s) timed in {:.1} s ({} of {} strategies' steps), kept in {}",
                    m.seconds,
                    m.strategies_run,
                    m.strategies_in_space,
                    m.cache.display()
                )?,
            }
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
    /// Devices this run does not measure on (GPUs, a cluster's workers): why not.
    Elsewhere { why: &'a str },
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
            let key = CacheKey::embedded_cpu(devices, precision);
            let read = cache.read(&key);
            let known: HashSet<ProfileKey> = read.db.entries.iter().map(|e| e.key()).collect();
            let space = space_strategies(graph, devices);
            let in_space = space.len();
            let (strategies, new_tiles) = left_to_measure(graph, space, &key.device_kind, &known);
            let started = Instant::now();
            let mut db = read.db;
            if !strategies.is_empty() {
                // The runs that measure check that each strategy fits this host first.
                for (_, configs) in &strategies {
                    legion_cluster::memory::check_this_host(graph, Some((configs, devices)))?;
                }
                // One timed step a strategy: each tile's cost is the median over the devices
                // that ran it, and the training steps refine it (`Job::run`).
                let settings = ProfileSettings {
                    warmup: 1,
                    repeats: 1,
                    device_kind: key.device_kind.clone(),
                    seed: 1,
                };
                let measured = legion_profile::profile_reporting(
                    graph,
                    devices,
                    &strategies,
                    &settings,
                    progress,
                )
                .with_context(|| {
                    format!("measuring {}'s op costs on {devices} devices", graph.name)
                })?;
                db = cache.add(&key, &measured.db)?.1;
            }
            report.measuring = Some(Measuring {
                strategies_run: strategies.len(),
                strategies_in_space: in_space,
                new_tiles,
                seconds: started.elapsed().as_secs_f64(),
                cache: cache.path(&key),
            });
            if db.entries.is_empty() {
                bail!("measuring {}'s op costs timed no tile", graph.name);
            }
            Ok(Pricing {
                db: Some(db),
                report,
                cache: Some((cache.clone(), key)),
                refused: read.refused,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::zoo::ZooConfig;

    fn lenet() -> Graph {
        let size = ZooConfig {
            batch: 8,
            image_size: 28,
            channels: 1,
            classes: 10,
        };
        crate::zoo("lenet5", size).unwrap()
    }

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
    fn each_new_tile_is_left_to_measure_once_and_known_ones_not_at_all() {
        let graph = lenet();
        let space = || space_strategies(&graph, 4);
        let (all, tiles) = left_to_measure(&graph, space(), "cpu", &HashSet::new());
        assert!(!all.is_empty() && tiles > 0);
        let every: HashSet<ProfileKey> = all
            .iter()
            .flat_map(|(_, configs)| tile_keys(&graph, configs, "cpu"))
            .collect();
        assert_eq!(every.len(), tiles, "each distinct tile counted once");
        let (none, zero) = left_to_measure(&graph, space(), "cpu", &every);
        assert!(none.is_empty());
        assert_eq!(zero, 0);
        // another kind's tiles are not this kind's
        let (again, same) = left_to_measure(&graph, space(), "h200", &every);
        assert_eq!((again.len(), same), (all.len(), tiles));
    }

    #[test]
    fn a_cache_file_is_named_by_its_key_and_refused_for_another() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CostCache::at(dir.path());
        let key = CacheKey {
            device_kind: "cpu".into(),
            precision: Precision::Fp32,
            host: "2 cores shared by 4 devices".into(),
        };
        let mut db = ProfileDb::default();
        let graph = lenet();
        let layer = graph.ids().nth(1).unwrap();
        let config = ParallelConfig::serial(0);
        let tile = legion_profile::Tile::of(&graph, layer, &config, 0, "cpu");
        db.record(
            graph.layer(layer),
            &tile.inputs,
            &tile.rect,
            "cpu",
            legion_planner::PhaseTimes {
                forward: 1e-3,
                backward: 2e-3,
            },
            3,
        );
        let (path, _) = cache.add(&key, &db).unwrap();
        assert_eq!(
            path.file_name().unwrap(),
            "cpu-fp32-2-cores-shared-by-4-devices.json"
        );
        let read = cache.read(&key);
        assert!(read.refused.is_none(), "{:?}", read.refused);
        assert_eq!(read.db.entries, db.entries);

        // The same file under another key (copied from a machine with other cores) is refused.
        let other = CacheKey {
            host: "16 cores shared by 4 devices".into(),
            ..key.clone()
        };
        std::fs::copy(&path, cache.path(&other)).unwrap();
        let read = cache.read(&other);
        assert!(read.db.entries.is_empty());
        let why = read.refused.unwrap();
        assert!(why.contains("not on cpu, fp32, 16 cores"), "{why}");
        // Entries of another device kind are refused too.
        let gpu = CacheKey {
            device_kind: "h200".into(),
            ..key.clone()
        };
        let mut text = std::fs::read_to_string(&path).unwrap();
        text = text.replace(&key.describe(), &gpu.describe());
        std::fs::write(cache.path(&gpu), text).unwrap();
        let why = cache.read(&gpu).refused.unwrap();
        assert!(why.contains("device kind 'cpu', not 'h200'"), "{why}");
    }

    #[test]
    fn a_corrupt_cache_file_is_named_ignored_and_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CostCache::at(dir.path());
        let key = CacheKey::embedded_cpu(2, Precision::Fp32);
        std::fs::write(cache.path(&key), "{\"version\": 1, \"entries\": [").unwrap();
        let read = cache.read(&key);
        let why = read.refused.unwrap();
        assert!(
            why.starts_with(&cache.path(&key).display().to_string()) && why.contains("rewrites"),
            "{why}"
        );
        cache.add(&key, &ProfileDb::default()).unwrap();
        assert!(cache.read(&key).refused.is_none());
    }
}
