//! Dynamic batching (a model's `[dynamic_batching]`): a compute worker takes the queue, gathers
//! the requests that arrive within `max_queue_delay_us` of the first one (or until a preferred
//! batch size is reached), groups the compatible ones, and runs each group as one call: inputs
//! concatenated along axis 0 into pooled memory, one launch, outputs split back.
//!
//! Compatible means what the operator's [`Batching`] declaration asks: equal attributes (floats
//! by their bits: `-0.0` is not `0.0`) and dtypes, equal shapes past axis 0, shared inputs equal
//! byte for byte, and a call the declaration accepts (no broadcasting, softmax not along axis
//! 0); and one session, whose pool (and quota) holds the merged call's memory. The declaration
//! promises that the split results equal the calls alone, bit for bit. A request's batch size
//! is its axis-0 length, as in Triton.
//!
//! Gathering takes from the queue only as many requests as would fill the batch: the rest stay
//! queued, and those taken still count against `max_queue_size` and as pending until they run.
//! Gathering stops at the deadline, or as soon as any group is full.

use std::sync::Arc;
use std::time::{Duration, Instant};

use opbridge_ops::dispatch;
use opbridge_ops::registry::Batching;
use opbridge_ops::Meta;
use opbridge_runtime::{DeviceContext, HostBytes, StreamId, Tensor};

use crate::error::{Result, ServeError};
use crate::executor::{Jobs, Queued};
use crate::infer::{self, Call, Checked, Output, Reply};
use crate::models::{ModelVersion, Times};
use crate::repository::DynamicBatching;

/// A model version's batching: the operator's declaration and the config's policy.
#[derive(Debug, Clone)]
pub struct BatchPolicy {
    op: Batching,
    delay: Duration,
    /// The batch size at which gathering stops: the largest preferred size, else the maximum.
    enough: usize,
    pub config: DynamicBatching,
}

impl BatchPolicy {
    pub fn new(op: Batching, config: &DynamicBatching) -> BatchPolicy {
        BatchPolicy {
            op,
            delay: Duration::from_micros(config.max_queue_delay_us),
            enough: config.preferred_batch_size.last().copied().unwrap_or(config.max_batch_size),
            config: config.clone(),
        }
    }
}

/// A request gathered for a batch, checked.
#[derive(Debug)]
struct Member {
    checked: Checked,
    reply: Reply,
    /// Its axis-0 length.
    rows: usize,
    queued_at: Instant,
}

/// Requests that run as one call; `rows` in all.
#[derive(Debug)]
struct Group {
    members: Vec<Member>,
    rows: usize,
    /// Whether others may join (a request the declaration refuses, or larger than the maximum
    /// batch, runs alone).
    open: bool,
}

/// A compute worker of a batching model: gathers a batch, then runs its groups.
pub fn work(stream: &opbridge_runtime::Stream, jobs: &Jobs<Call>) -> bool {
    let taken = jobs.take();
    let Some(first) = taken.next() else { return false };
    let model = Arc::clone(&first.item.model);
    let Some(policy) = model.batching.as_ref() else {
        drop(taken);
        run_groups(&model, gather_one(&model, None, first, Vec::new()), stream);
        return true;
    };
    let deadline = first.at + policy.delay;
    let mut groups = gather_one(&model, Some(policy), first, Vec::new());
    // A first request that cannot be batched does not wait for company, and a full group does
    // not wait for the others.
    while let Some(group) = groups.first().filter(|g| g.open) {
        if groups.iter().any(|g| g.open && g.rows >= policy.enough) {
            break;
        }
        // Woken once as many requests as would fill the batch are queued (guessing they are
        // the size of those so far), or at the deadline: not by each arrival.
        let rows_each = (group.rows / group.members.len()).max(1);
        let arrived = taken.when((policy.enough - group.rows).div_ceil(rows_each), deadline);
        if arrived.is_empty() {
            break;
        }
        for queued in arrived {
            groups = gather_one(&model, Some(policy), queued, groups);
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    // The queue goes to the next worker while this one runs the batch.
    drop(taken);
    run_groups(&model, groups, stream);
    true
}

/// Checks one queued request and puts it in the first open group it fits, or a new one; a
/// request that fails its checks is answered at once.
fn gather_one(
    model: &ModelVersion,
    policy: Option<&BatchPolicy>,
    queued: Queued<Call>,
    mut groups: Vec<Group>,
) -> Vec<Group> {
    let Queued { item: call, at } = queued;
    let Call { request, max_input_bytes, reply, .. } = call;
    let checked = match request.check(model, max_input_bytes, reply.session.as_ref(), at) {
        Ok(checked) => checked,
        Err(error) => {
            reply.answer(Err(error));
            return groups;
        }
    };
    // Its batch size, where the declaration accepts the call: what it counts for even alone.
    let declared = policy.and_then(|p| p.op.rows_of(&checked.metas(), &checked.attrs));
    // A call in shared memory runs alone, in place: merging would copy it.
    let rows =
        declared.filter(|&rows| checked.shm.is_none() && policy.is_some_and(|p| rows <= p.config.max_batch_size));
    let (Some(policy), Some(rows)) = (policy, rows) else {
        let rows = declared.unwrap_or(1);
        let member = Member { checked, reply, rows, queued_at: at };
        groups.push(Group { members: vec![member], rows, open: false });
        return groups;
    };
    let fits = |g: &Group| {
        g.open
            && g.rows + rows <= policy.config.max_batch_size
            && same_session(&g.members[0].reply, &reply)
            && compatible(&policy.op, &g.members[0].checked, &checked)
    };
    let place = groups.iter().position(fits);
    let member = Member { checked, reply, rows, queued_at: at };
    match place {
        Some(i) => {
            groups[i].rows += rows;
            groups[i].members.push(member);
        }
        None => groups.push(Group { members: vec![member], rows, open: true }),
    }
    groups
}

/// Whether two requests are in one session (or both in none): a merged call's memory comes
/// from one pool.
fn same_session(a: &Reply, b: &Reply) -> bool {
    match (&a.session, &b.session) {
        (None, None) => true,
        (Some(a), Some(b)) => a.same_pool(b),
        _ => false,
    }
}

/// Whether two checked calls can run as one (see the module documentation).
fn compatible(op: &Batching, a: &Checked, b: &Checked) -> bool {
    a.attrs.same_as(&b.attrs)
        && a.inputs.len() == b.inputs.len()
        && a.inputs.iter().zip(&b.inputs).enumerate().all(|(i, pair)| match pair {
            (None, None) => true,
            (Some(x), Some(y)) if x.dtype == y.dtype => {
                if op.shared.contains(&i) {
                    x.shape == y.shape && x.bytes == y.bytes
                } else {
                    x.shape.len() == y.shape.len() && x.shape[1..] == y.shape[1..]
                }
            }
            _ => false,
        })
}

fn run_groups(model: &ModelVersion, groups: Vec<Group>, stream: &opbridge_runtime::Stream) {
    for group in groups {
        if group.members.len() == 1 || !group.open {
            for member in group.members {
                run_member_alone(model, member, stream);
            }
            continue;
        }
        let rows = group.rows;
        match run_merged(model, &group.members, rows, stream) {
            Ok(merged) => split(model, group.members, merged, stream),
            // A merged call that fails (a kernel refusing one request's values, memory) is
            // run again request by request, so each gets its own answer.
            Err(error) => {
                infer::settle(stream);
                tracing::debug!(
                    model = model.model,
                    rows,
                    "a merged call failed, running its requests alone: {}",
                    error.message
                );
                for member in group.members {
                    run_member_alone(model, member, stream);
                }
            }
        }
    }
}

fn run_member_alone(model: &ModelVersion, member: Member, stream: &opbridge_runtime::Stream) {
    let Member { checked, reply, rows, queued_at } = member;
    let queue_ns = queued_at.elapsed().as_nanos() as u64;
    let outcome = infer::run_alone(model, checked, stream, reply.session.as_ref(), queue_ns, rows as u64);
    reply.answer(outcome);
}

/// A merged call's outputs, with its timings.
struct Merged {
    outputs: Vec<Tensor>,
    started: Instant,
    input_ns: u64,
    infer_ns: u64,
}

/// Runs `members` as one call of `rows` rows, in their session's pool (else the model's
/// device pool): over its quota, the call fails and its requests run alone, each answered
/// with its own outcome.
fn run_merged(
    model: &ModelVersion,
    members: &[Member],
    rows: usize,
    stream: &opbridge_runtime::Stream,
) -> Result<Merged> {
    let started = Instant::now();
    let ctx = DeviceContext::get(model.device)?;
    let alloc = infer::allocator(ctx, members[0].reply.session.as_ref());
    let first = &members[0].checked;
    let shared = model.batching.as_ref().map_or(&[][..], |p| p.op.shared);
    let mut metas = Vec::with_capacity(first.inputs.len());
    let mut inputs = Vec::with_capacity(first.inputs.len());
    for (i, input) in first.inputs.iter().enumerate() {
        let Some(input) = input else {
            metas.push(None);
            inputs.push(None);
            continue;
        };
        let mut shape = input.shape.clone();
        let tensor = if shared.contains(&i) {
            infer::tensor_from_bytes(alloc, &shape, input.dtype, &input.bytes, stream)?
        } else {
            shape[0] = rows;
            let mut bytes = Vec::with_capacity(members.iter().map(|m| m.input_len(i)).sum());
            for member in members {
                bytes.extend_from_slice(member.checked.inputs[i].as_ref().map_or(&[][..], |x| &x.bytes[..]));
            }
            infer::tensor_from_bytes(alloc, &shape, input.dtype, &bytes, stream)?
        };
        metas.push(Some(Meta::new(input.dtype, &shape)));
        inputs.push(Some(Arc::new(tensor)));
    }
    let plan = dispatch::plan(&model.entry, &metas, &first.attrs)?;
    if plan.outputs.iter().any(|m| m.shape.first() != Some(&rows)) {
        return Err(ServeError::internal(format!(
            "operator '{}' declares batching, but a merged call of {rows} rows gives outputs of shapes {:?}",
            model.entry.schema().name,
            plan.outputs.iter().map(|m| m.shape.to_vec()).collect::<Vec<_>>()
        )));
    }
    let input_ns = started.elapsed().as_nanos() as u64;
    let computing = Instant::now();
    let outputs = infer::compute(model, &first.attrs, &plan, &inputs, stream, alloc)?;
    Ok(Merged { outputs, started, input_ns, infer_ns: computing.elapsed().as_nanos() as u64 })
}

impl Member {
    fn input_len(&self, i: usize) -> usize {
        self.checked.inputs[i].as_ref().map_or(0, |x| x.bytes.len())
    }
}

/// Splits a merged call's outputs back along axis 0 into each request's own tensors (from its
/// session's pool when it has one), answers every request, and records the execution.
fn split(model: &ModelVersion, members: Vec<Member>, merged: Merged, stream: &opbridge_runtime::Stream) {
    let splitting = Instant::now();
    let rows: usize = members.iter().map(|m| m.rows).sum();
    let whole: Vec<Result<HostBytes>> = merged.outputs.into_iter().map(|t| infer::host_bytes(t, stream)).collect();
    let mut offset = 0;
    let mut answers = Vec::with_capacity(members.len());
    for member in members {
        let outcome = member_outputs(model, &member, &whole, offset, rows);
        offset += member.rows;
        answers.push((member, outcome));
    }
    let times = Times {
        queue_ns: 0,
        input_ns: merged.input_ns,
        infer_ns: merged.infer_ns,
        output_ns: splitting.elapsed().as_nanos() as u64,
    };
    model.stats.execution(&times, rows, model.path());
    for (member, outcome) in answers {
        let Member { reply, rows, queued_at, .. } = member;
        let queue_ns = merged.started.saturating_duration_since(queued_at).as_nanos() as u64;
        model.stats.request(&Times { queue_ns, ..times }, rows as u64);
        if let Some(lease) = reply.session.as_ref() {
            lease.observe_peak();
        }
        reply.answer(outcome);
    }
}

/// One request's part of the merged outputs: rows `offset..offset + member.rows` of each
/// output it asked for, copied into a tensor of its own.
fn member_outputs(
    model: &ModelVersion,
    member: &Member,
    whole: &[Result<HostBytes>],
    offset: usize,
    rows: usize,
) -> Result<Vec<Output>> {
    let ctx = DeviceContext::get(model.device)?;
    // The parts are host memory: the session's pool on the CPU, the host pool for an
    // accelerator's model (whose results came back to the host whole).
    let alloc = match infer::host_memory(ctx.pool())? {
        true => infer::allocator(ctx, member.reply.session.as_ref()),
        false => DeviceContext::cpu().pool(),
    };
    let mut outputs = Vec::new();
    for (k, output) in whole.iter().enumerate() {
        let Some(binary) = member.checked.wanted[k] else { continue };
        let output = output.as_ref().map_err(Clone::clone)?;
        let tensor = output.tensor();
        let row_bytes = tensor.nbytes() / rows.max(1);
        let mut shape = tensor.shape().to_vec();
        shape[0] = member.rows;
        let mut part = Tensor::empty_in(alloc, &shape, tensor.dtype(), StreamId::HOST)?;
        let bytes: &[u8] = output.as_ref();
        part.write_from_host(&bytes[offset * row_bytes..(offset + member.rows) * row_bytes])?;
        let data = part.into_host_bytes().map_err(|failed| ServeError::from(failed.1))?;
        outputs.push(infer::output(model, k, data, binary));
    }
    Ok(outputs)
}
