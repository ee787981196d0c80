//! The per-message tables: t_x of every layout pair from its messages, on any machine and for any
//! projection (the factorized tables' fallback: irregular machines, reduction splits, projections
//! not separable per axis, and shared lanes, where loads add up).
//!
//! A layout pair's tile overlaps are enumerated box by box into [`Message`]s once; its block pairs
//! are grouped into classes with identical links ([`PairClass`]), and each class is priced once: by
//! its largest message where every device pair has the same link, message by message where links
//! are mixed or messages share lanes ([`SlotLoads`]).

use super::{ConfigSubset, EdgeGeometry};
use crate::config::{ConfigSpace, block_of, block_range};
use crate::fast_hash::FastHashMap;
use crate::machine::{Lane, Link, MachineModel};
use crate::transfer::lane_seconds;
use legion_ops::shape::MAX_DIMS;

/// One producer-tile → consumer-tile message of a layout pair.
#[derive(Clone, Copy, Debug)]
struct Message {
    src_tile: usize,
    dst_tile: usize,
    bytes: f64,
}

/// Every ordered device pair's route on a machine with shared lanes, with what its messages load
/// numbered densely ("slots": one per lane, or private link, and link that loads it).
struct SharedRoutes {
    /// By `a * n + b`.
    pairs: Vec<PairRoute>,
    /// Per slot: its lane or private link (numbered densely), and the link's seconds per byte and
    /// latency.
    slots: Vec<Slot>,
    /// Whether some lane is loaded by messages of several links (per-pair overrides): its slots'
    /// seconds then add up.
    mixed: bool,
}

#[derive(Clone, Copy)]
struct Slot {
    lane: u32,
    seconds_per_byte: f64,
    latency_s: f64,
}

impl Slot {
    /// The order in which a mixed lane adds its links' seconds, as [`crate::transfer::Loads`].
    fn order(&self) -> (u32, u64, u64) {
        (
            self.lane,
            self.seconds_per_byte.to_bits(),
            self.latency_s.to_bits(),
        )
    }
}

/// The slots a message on one ordered pair loads: [`NO_SLOT`] where fewer (a device and itself:
/// none; a private link or a host bridge: one).
#[derive(Clone, Copy)]
struct PairRoute {
    slots: [u32; 2],
    lanes: Option<(Lane, Lane)>,
}

const NO_SLOT: u32 = u32::MAX;

impl SharedRoutes {
    fn new(machine: &MachineModel) -> SharedRoutes {
        let n = machine.num_devices();
        let lanes = machine.num_lanes();
        let mut private: FastHashMap<usize, u32> = FastHashMap::default();
        let mut ids: FastHashMap<(u32, u64, u64), u32> = FastHashMap::default();
        let mut slots: Vec<Slot> = Vec::new();
        let pairs = (0..n * n)
            .map(|ab| {
                let Some(route) = machine.route(ab / n, ab % n) else {
                    return PairRoute {
                        slots: [NO_SLOT; 2],
                        lanes: None,
                    };
                };
                let mut slot = |lane: u32| {
                    let slot = Slot {
                        lane,
                        seconds_per_byte: route.link.seconds_per_byte(),
                        latency_s: route.link.latency_s,
                    };
                    *ids.entry(slot.order()).or_insert_with(|| {
                        slots.push(slot);
                        (slots.len() - 1) as u32
                    })
                };
                let slots = match route.lanes {
                    Some((out, into)) if out == into => [slot(out as u32), NO_SLOT],
                    Some((out, into)) => [slot(out as u32), slot(into as u32)],
                    None => {
                        let next = (lanes + private.len()) as u32;
                        let lane = *private.entry(ab).or_insert(next);
                        [slot(lane), NO_SLOT]
                    }
                };
                PairRoute {
                    slots,
                    lanes: route.lanes,
                }
            })
            .collect();
        let mut lane_slots: FastHashMap<u32, usize> = FastHashMap::default();
        for s in &slots {
            *lane_slots.entry(s.lane).or_default() += 1;
        }
        SharedRoutes {
            pairs,
            mixed: lane_slots.values().any(|&n| n > 1),
            slots,
        }
    }
}

/// Bytes and messages per slot of [`SharedRoutes`], summed exactly and priced once, as
/// [`crate::transfer::Loads`] prices them.
struct SlotLoads {
    bytes: Vec<u64>,
    messages: Vec<u64>,
    touched: Vec<u32>,
}

impl SlotLoads {
    fn new(slots: usize) -> SlotLoads {
        SlotLoads {
            bytes: vec![0; slots],
            messages: vec![0; slots],
            touched: Vec::new(),
        }
    }

    fn add(&mut self, route: &PairRoute, bytes: u64) {
        for slot in route.slots.into_iter().filter(|&s| s != NO_SLOT) {
            let slot = slot as usize;
            if self.messages[slot] == 0 {
                self.touched.push(slot as u32);
            }
            self.bytes[slot] += bytes;
            self.messages[slot] += 1;
        }
    }

    /// The busiest lane's or private link's seconds; every slot back to zero.
    fn take_busiest(&mut self, routes: &SharedRoutes) -> f64 {
        let mut seconds = |slot: u32| {
            let s = &routes.slots[slot as usize];
            let (bytes, messages) = (
                std::mem::take(&mut self.bytes[slot as usize]),
                std::mem::take(&mut self.messages[slot as usize]),
            );
            lane_seconds(bytes, messages, s.seconds_per_byte, s.latency_s)
        };
        let mut busiest = 0.0f64;
        if !routes.mixed {
            for slot in std::mem::take(&mut self.touched) {
                busiest = busiest.max(seconds(slot));
            }
            return busiest;
        }
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable_by_key(|&s| routes.slots[s as usize].order());
        let mut i = 0;
        while i < touched.len() {
            let lane = routes.slots[touched[i] as usize].lane;
            let mut lane_total = 0.0;
            while i < touched.len() && routes.slots[touched[i] as usize].lane == lane {
                lane_total += seconds(touched[i]);
                i += 1;
            }
            busiest = busiest.max(lane_total);
        }
        touched.clear();
        self.touched = touched;
        busiest
    }
}

/// The per-message tables of one machine: its device pairs grouped by their links, and for every
/// (producer total, consumer total) its block pairs grouped into classes.
pub(super) struct PerMessage {
    devices: usize,
    /// On a machine with shared lanes, every ordered pair's route: block pairs are then priced
    /// message by message, each message loading its route's lanes.
    routes: Option<SharedRoutes>,
    /// Per ordered device pair, the index of its (forward, backward) links; 0 for a device and itself.
    kind: Vec<u16>,
    forward: Vec<Link>,
    backward: Vec<Link>,
    /// By `log2(src blocks' size) * levels + log2(dst blocks' size)`.
    classes: Vec<PairClasses>,
    levels: usize,
    /// Bytes of an element that moves ([`MachineModel::activation_bytes`]).
    element_bytes: u64,
}

/// The block pairs of one (producer total, consumer total) that are alike.
struct PairClasses {
    dst_blocks: usize,
    /// Class of block pair (src block i, dst block j) at `i * dst_blocks + j`.
    class_of: Vec<u32>,
    classes: Vec<PairClass>,
}

enum PairClass {
    /// Every device pair uses link kind `k` (0: every tile pair shares a device).
    Uniform(u16),
    /// Mixed links: evaluated message by message at this representative block pair.
    Mixed { src_first: usize, dst_first: usize },
    /// Shared lanes: every message loads its route's link or lanes, at this representative block
    /// pair (whose routes share lanes as every block pair of the class does).
    Shared { src_first: usize, dst_first: usize },
}

impl PerMessage {
    pub(super) fn new(machine: &MachineModel) -> PerMessage {
        let n = machine.num_devices();
        let mut kind = vec![0u16; n * n];
        let mut forward = vec![Link {
            bytes_per_s: f64::INFINITY,
            latency_s: 0.0,
        }];
        let mut backward = forward.clone();
        let mut ids: FastHashMap<[u64; 4], u16> = FastHashMap::default();
        for a in 0..n {
            for b in 0..n {
                let (Some(f), Some(r)) = (machine.link(a, b), machine.link(b, a)) else {
                    continue;
                };
                let key = [
                    f.bytes_per_s.to_bits(),
                    f.latency_s.to_bits(),
                    r.bytes_per_s.to_bits(),
                    r.latency_s.to_bits(),
                ];
                kind[a * n + b] = *ids.entry(key).or_insert_with(|| {
                    forward.push(f);
                    backward.push(r);
                    (forward.len() - 1) as u16
                });
            }
        }
        let sizes: Vec<usize> = (0..).map(|k| 1usize << k).take_while(|&s| s <= n).collect();
        let routes = machine
            .has_shared_lanes()
            .then(|| SharedRoutes::new(machine));
        let mut pairs = PerMessage {
            devices: n,
            routes,
            kind,
            forward,
            backward,
            classes: Vec::new(),
            levels: sizes.len(),
            element_bytes: machine.activation_bytes(),
        };
        for &src in &sizes {
            for &dst in &sizes {
                let c = pairs.classify(src, dst);
                pairs.classes.push(c);
            }
        }
        pairs
    }

    /// The classes of the block pairs of producer blocks of `src_total` devices and consumer blocks
    /// of `dst_total`.
    fn classify(&self, src_total: usize, dst_total: usize) -> PairClasses {
        let n = self.devices;
        let src_blocks = n / src_total;
        let dst_blocks = n / dst_total;
        let mut seen: FastHashMap<Vec<u32>, u32> = FastHashMap::default();
        let mut class_of = Vec::with_capacity(src_blocks * dst_blocks);
        let mut classes = Vec::new();
        let mut matrix: Vec<u32> = Vec::with_capacity(src_total * dst_total);
        // lanes renumbered by first use within the block pair: block pairs alike share lanes alike
        let mut lane_ids: FastHashMap<Lane, u32> = FastHashMap::default();
        for i in 0..src_blocks {
            for j in 0..dst_blocks {
                let (s, d) = (i * src_total, j * dst_total);
                matrix.clear();
                for a in s..s + src_total {
                    matrix.extend(
                        self.kind[a * n + d..a * n + d + dst_total]
                            .iter()
                            .map(|&k| u32::from(k)),
                    );
                }
                if let Some(routes) = &self.routes {
                    lane_ids.clear();
                    for a in s..s + src_total {
                        for b in d..d + dst_total {
                            for (x, y) in [(a, b), (b, a)] {
                                let lanes = routes.pairs[x * n + y].lanes;
                                for lane in lanes.map(|(o, i)| [o, i]).into_iter().flatten() {
                                    let next = lane_ids.len() as u32;
                                    matrix.push(*lane_ids.entry(lane).or_insert(next));
                                }
                                matrix.push(u32::MAX);
                            }
                        }
                    }
                }
                let next = classes.len() as u32;
                // look up before cloning: most block pairs repeat an earlier matrix
                let id = match seen.get(&matrix) {
                    Some(&id) => id,
                    None => {
                        seen.insert(matrix.clone(), next);
                        next
                    }
                };
                if id == next {
                    let first = matrix[0];
                    classes.push(if self.routes.is_some() {
                        PairClass::Shared {
                            src_first: s,
                            dst_first: d,
                        }
                    } else if matrix.iter().all(|&k| k == first) {
                        PairClass::Uniform(first as u16)
                    } else {
                        PairClass::Mixed {
                            src_first: s,
                            dst_first: d,
                        }
                    });
                }
                class_of.push(id);
            }
        }
        PairClasses {
            dst_blocks,
            class_of,
            classes,
        }
    }

    fn classes(&self, src_total: usize, dst_total: usize) -> &PairClasses {
        let level = |t: usize| t.trailing_zeros() as usize;
        &self.classes[level(src_total) * self.levels + level(dst_total)]
    }

    /// t_x (forward, and backward with `gradient`) of `messages` at a block pair of class `class`.
    fn class_time(
        &self,
        class: &PairClass,
        messages: &[Message],
        largest: f64,
        gradient: bool,
        loads: &mut [SlotLoads; 2],
    ) -> f64 {
        let both = |forward: f64, backward: f64| {
            if gradient {
                forward + backward
            } else {
                forward
            }
        };
        match *class {
            PairClass::Uniform(0) => 0.0,
            PairClass::Uniform(_) if messages.is_empty() => 0.0,
            PairClass::Uniform(k) => {
                let k = k as usize;
                both(
                    self.forward[k].message_time(largest),
                    self.backward[k].message_time(largest),
                )
            }
            PairClass::Mixed {
                src_first,
                dst_first,
            } => {
                let n = self.devices;
                let (mut forward, mut backward) = (0.0f64, 0.0f64);
                for m in messages {
                    let k =
                        self.kind[(src_first + m.src_tile) * n + dst_first + m.dst_tile] as usize;
                    if k != 0 {
                        forward = forward.max(self.forward[k].message_time(m.bytes));
                        backward = backward.max(self.backward[k].message_time(m.bytes));
                    }
                }
                both(forward, backward)
            }
            PairClass::Shared {
                src_first,
                dst_first,
            } => {
                let n = self.devices;
                let routes = self.routes.as_ref().expect("shared classes have routes");
                let [forward, backward] = loads;
                for m in messages {
                    let (a, b) = (src_first + m.src_tile, dst_first + m.dst_tile);
                    forward.add(&routes.pairs[a * n + b], m.bytes as u64);
                    backward.add(&routes.pairs[b * n + a], m.bytes as u64);
                }
                both(forward.take_busiest(routes), backward.take_busiest(routes))
            }
        }
    }

    /// The per-message table: overlaps enumerated box by box for every layout pair.
    pub(super) fn edge_table(
        &self,
        geometry: &EdgeGeometry,
        src_space: &ConfigSpace,
        dst_space: &ConfigSpace,
        keep_pairs: Option<&[bool]>,
        only: Option<&ConfigSubset>,
    ) -> Vec<f64> {
        let (producer, needs, gradient) = (&geometry.producer, &geometry.needs, geometry.gradient);
        let nd = producer.ndim();
        let extents = producer.dims();
        let columns = dst_space.len();
        let layouts = dst_space.layouts().len();
        let mut table = vec![0.0; src_space.len() * columns];
        let mut messages: Vec<Message> = Vec::new();
        let mut values: Vec<f64> = Vec::new();
        let slots = self.routes.as_ref().map_or(0, |r| r.slots.len());
        let mut loads = [SlotLoads::new(slots), SlotLoads::new(slots)];
        for (gi, g) in src_space.layouts().iter().enumerate() {
            // under a reduction split a block's output is on its first partial's device
            let src_red = src_space.layout_reduction(gi);
            let src_total: usize = g.iter().product::<usize>() * src_red;
            for (hi, h) in dst_space.layouts().iter().enumerate() {
                let dst_total: usize = h.iter().product::<usize>() * dst_space.layout_reduction(hi);
                // a pair the bounded search ruled out, or whose configs are all outside `only`:
                // never read, as in the factorised path
                let unread = only.is_some_and(|o| {
                    ConfigSubset::positions(o.rows, src_space.layout_configs(gi)).is_empty()
                        || ConfigSubset::positions(o.columns, dst_space.layout_configs(hi))
                            .is_empty()
                });
                if unread || keep_pairs.is_some_and(|keep| !keep[gi * layouts + hi]) {
                    let dst_configs = dst_space.layout_configs(hi);
                    for row in src_space.layout_configs(gi) {
                        table[row * columns..][dst_configs.clone()].fill(f64::INFINITY);
                    }
                    continue;
                }
                messages.clear();
                let mut largest = 0.0f64;
                for (dst_tile, need) in needs[hi].iter().enumerate() {
                    if need.is_empty() {
                        continue;
                    }
                    let mut first = [0; MAX_DIMS];
                    let mut last = [0; MAX_DIMS];
                    for a in 0..nd {
                        first[a] = block_of(extents[a], g[a], need.lo[a]);
                        last[a] = block_of(extents[a], g[a], need.hi[a] - 1);
                    }
                    let mut idx = first;
                    loop {
                        let mut volume = 1;
                        let mut src_tile = 0;
                        for a in 0..nd {
                            let (lo, hi) = block_range(extents[a], g[a], idx[a]);
                            volume *= hi.min(need.hi[a]) - lo.max(need.lo[a]);
                            src_tile = src_tile * g[a] + idx[a];
                        }
                        let bytes = (self.element_bytes * volume as u64) as f64;
                        largest = largest.max(bytes);
                        messages.push(Message {
                            src_tile: src_tile * src_red,
                            dst_tile,
                            bytes,
                        });
                        // advance the odometer over the box first..=last
                        let mut a = nd;
                        while a > 0 {
                            a -= 1;
                            if idx[a] < last[a] {
                                idx[a] += 1;
                                break;
                            }
                            idx[a] = first[a];
                        }
                        if idx == first {
                            break;
                        }
                    }
                }
                let classes = self.classes(src_total, dst_total);
                values.clear();
                values.extend(
                    classes
                        .classes
                        .iter()
                        .map(|c| self.class_time(c, &messages, largest, gradient, &mut loads)),
                );
                let src_configs = src_space.layout_configs(gi);
                let dst_configs = dst_space.layout_configs(hi);
                let per_row = dst_configs.len();
                for (si, row) in src_configs.enumerate() {
                    let out = &mut table[row * columns + dst_configs.start..][..per_row];
                    let class_row = &classes.class_of[si * classes.dst_blocks..][..per_row];
                    for (o, &c) in out.iter_mut().zip(class_row) {
                        *o = values[c as usize];
                    }
                }
            }
        }
        table
    }
}
