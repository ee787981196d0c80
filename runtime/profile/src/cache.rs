//! The persistent cache of measured op costs ([`CostCache`]): one profile file per kind of device
//! and what else decides a tile's time ([`CacheKey`]), so that a run measures only the tiles no
//! earlier run of that kind measured. [`measure_missing`] is the one way a run fills it before its
//! search, on an embedded cluster's devices and on each worker of a cluster alike.

use crate::{ProfileSettings, profile_reporting, space_strategies, tile_keys};
use anyhow::Context;
use legion_ops::{Graph, Precision};
use legion_planner::profile::ProfileKey;
use legion_planner::progress::Progress;
use legion_planner::{ParallelConfig, ProfileDb};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
    /// `devices` devices on this machine's cores: an embedded cluster's, or a worker's.
    pub fn cpu_devices(devices: usize, precision: Precision) -> CacheKey {
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
fn left_to_measure(
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

/// What [`measure_missing`] did: the costs the cache now holds for its key, and what was timed.
#[derive(Debug)]
pub struct Measured {
    pub db: ProfileDb,
    /// Strategies whose steps were timed, of those the search space needs.
    pub strategies_run: usize,
    pub strategies_in_space: usize,
    pub new_tiles: usize,
    pub seconds: f64,
    /// The cache file the costs are kept in.
    pub cache: PathBuf,
    /// The cache file as it was refused ([`CacheRead::refused`]), for a warning.
    pub refused: Option<String>,
}

/// Times, on `devices` devices of this process, the tiles of `graph`'s search space for them that
/// `cache` lacks under `key`, one step of each strategy that has new ones, and adds them to the
/// cache. `fits` refuses a strategy that would not fit this host before anything is allocated.
pub fn measure_missing(
    graph: &Graph,
    devices: usize,
    key: &CacheKey,
    cache: &CostCache,
    fits: &dyn Fn(&[ParallelConfig]) -> anyhow::Result<()>,
    progress: Option<&dyn Progress>,
) -> anyhow::Result<Measured> {
    let read = cache.read(key);
    let known: HashSet<ProfileKey> = read.db.entries.iter().map(|e| e.key()).collect();
    let space = space_strategies(graph, devices);
    let strategies_in_space = space.len();
    let (strategies, new_tiles) = left_to_measure(graph, space, &key.device_kind, &known);
    let started = Instant::now();
    let mut db = read.db;
    if !strategies.is_empty() {
        for (_, configs) in &strategies {
            fits(configs)?;
        }
        // One timed step a strategy: each tile's cost is the median over the devices that ran
        // it, and training steps refine it.
        let settings = ProfileSettings {
            warmup: 1,
            repeats: 1,
            device_kind: key.device_kind.clone(),
            seed: 1,
        };
        let measured = profile_reporting(graph, devices, &strategies, &settings, progress)
            .with_context(|| format!("measuring {}'s op costs on {devices} devices", graph.name))?;
        db = cache.add(key, &measured.db)?.1;
    }
    if db.entries.is_empty() {
        anyhow::bail!("measuring {}'s op costs timed no tile", graph.name);
    }
    Ok(Measured {
        db,
        strategies_run: strategies.len(),
        strategies_in_space,
        new_tiles,
        seconds: started.elapsed().as_secs_f64(),
        cache: cache.path(key),
        refused: read.refused,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use legion_ops::zoo::ZooConfig;
    use legion_planner::PhaseTimes;

    fn lenet() -> Graph {
        let size = ZooConfig {
            batch: 8,
            image_size: 28,
            channels: 1,
            classes: 10,
        };
        legion_ops::zoo::find("lenet5")
            .unwrap()
            .build(&size)
            .unwrap()
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
        let tile = crate::Tile::of(&graph, layer, &config, 0, "cpu");
        db.record(
            graph.layer(layer),
            &tile.inputs,
            &tile.rect,
            "cpu",
            PhaseTimes {
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
        let key = CacheKey::cpu_devices(2, Precision::Fp32);
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
