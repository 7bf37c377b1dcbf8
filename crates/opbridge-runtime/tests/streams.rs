//! Integration tests of streams, events, cross-stream tensor ordering and the staged pipeline
//! on the CPU device.
//!
//! `DeviceContext::synchronize` waits for (and reports the errors of) every stream of the
//! device, and the pool's counters are global, so the tests of this file take one lock and run
//! one at a time. Kernels that must stay busy block on a channel instead of sleeping: the test
//! releases them, and if it panics first, dropping the sender releases them too.
#![allow(unsafe_code)] // the tests' kernels read and write tensor memory, as kernels do

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use opbridge_runtime::pipeline::{staged_map, PipelineReport};
use opbridge_runtime::{
    current_stream, set_current_stream, test_device, AsyncError, DType, DeviceContext, DeviceId, DevicePtr, Error,
    ErrorKind, Event, HostFn, Stream, StreamId, Tensor,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn new_stream(ctx: &DeviceContext) -> Stream {
    Stream::new(ctx).expect("creating a stream")
}

type Log<T> = Arc<Mutex<Vec<T>>>;

fn new_log<T>() -> Log<T> {
    Arc::new(Mutex::new(Vec::new()))
}

fn logged<T: Clone>(log: &Log<T>) -> Vec<T> {
    log.lock().unwrap().clone()
}

/// A kernel that pushes `value` to `log`.
fn push<T: Send + 'static>(log: &Log<T>, value: T) -> HostFn {
    let log = Arc::clone(log);
    Box::new(move || {
        log.lock().unwrap().push(value);
        Ok(())
    })
}

/// A kernel that blocks its stream until the returned sender sends (or is dropped).
fn gate() -> (mpsc::Sender<()>, HostFn) {
    let (release, gate) = mpsc::channel::<()>();
    let kernel: HostFn = Box::new(move || {
        let _ = gate.recv();
        Ok(())
    });
    (release, kernel)
}

fn sleep_kernel(ms: u64) -> HostFn {
    Box::new(move || {
        thread::sleep(Duration::from_millis(ms));
        Ok(())
    })
}

fn launches_on_one_stream_run_in_order(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = new_stream(ctx);
    assert_eq!(stream.device(), DeviceId::CPU);
    assert_ne!(stream.id(), StreamId::HOST);
    let log = new_log();
    for i in 0..1000 {
        stream.launch(push(&log, i)).unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(logged(&log), (0..1000).collect::<Vec<_>>());
    assert!(stream.query());
}
test_device!(launches_on_one_stream_run_in_order);

fn host_funcs_run_in_order_with_kernels(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = new_stream(ctx);
    let log = new_log();
    let (release, blocked) = gate();
    stream.launch(blocked).unwrap();
    for i in 0..30 {
        if i % 3 == 0 {
            stream.launch_host_func(push(&log, format!("host {i}"))).unwrap();
        } else {
            stream.launch(push(&log, format!("kernel {i}"))).unwrap();
        }
    }
    assert!(logged(&log).is_empty(), "a host func waits for the earlier kernels");
    release.send(()).unwrap();
    stream.synchronize().unwrap();
    let expected: Vec<String> =
        (0..30).map(|i| if i % 3 == 0 { format!("host {i}") } else { format!("kernel {i}") }).collect();
    assert_eq!(logged(&log), expected);
}
test_device!(host_funcs_run_in_order_with_kernels);

fn streams_are_distinct_and_comparable(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (a, b) = (new_stream(ctx), new_stream(ctx));
    assert_ne!(a, b);
    assert_ne!(a.id(), b.id());
    assert_eq!(a.clone(), a, "a clone is a handle to the same stream");
    assert!(format!("{a:?}").contains("cpu:0"));
}
test_device!(streams_are_distinct_and_comparable);

fn each_thread_has_its_own_current_stream(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let here = ctx.current_stream().unwrap();
    assert_eq!(current_stream(ctx).unwrap(), here, "same thread, same stream");
    assert_eq!(ctx.current_stream().unwrap(), here);
    let (x, y) = thread::scope(|s| {
        let per_thread = || {
            let first = current_stream(ctx).unwrap();
            assert_eq!(current_stream(ctx).unwrap(), first);
            first.id()
        };
        let x = s.spawn(per_thread);
        let y = s.spawn(per_thread);
        (x.join().unwrap(), y.join().unwrap())
    });
    assert_ne!(x, y);
    assert_ne!(x, here.id());
    assert_ne!(y, here.id());
    assert_eq!(ctx.current_stream().unwrap(), here, "other threads did not change this one's");
}
test_device!(each_thread_has_its_own_current_stream);

fn set_current_stream_returns_the_previous_one(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    // A fresh thread has no current stream until it asks for one or sets one.
    thread::scope(|s| {
        s.spawn(|| {
            let mine = new_stream(ctx);
            assert_eq!(set_current_stream(mine.clone()), None);
            assert_eq!(current_stream(ctx).unwrap(), mine);
        });
    });
    let original = current_stream(ctx).unwrap();
    let other = new_stream(ctx);
    let previous = set_current_stream(other.clone());
    assert_eq!(previous.as_ref(), Some(&original));
    assert_eq!(current_stream(ctx).unwrap(), other);
    // What a `with stream:` block does on exit.
    let restored = set_current_stream(previous.unwrap());
    assert_eq!(restored, Some(other));
    assert_eq!(current_stream(ctx).unwrap(), original);
}
test_device!(set_current_stream_returns_the_previous_one);

fn synchronize_waits_for_the_stream(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = new_stream(ctx);
    let done = Arc::new(AtomicBool::new(false));
    let (release, blocked) = gate();
    stream.launch(blocked).unwrap();
    let flag = Arc::clone(&done);
    stream
        .launch(Box::new(move || {
            flag.store(true, Ordering::SeqCst);
            Ok(())
        }))
        .unwrap();
    assert!(!stream.query(), "work is still queued");
    assert!(!done.load(Ordering::SeqCst));
    release.send(()).unwrap();
    stream.synchronize().unwrap();
    assert!(done.load(Ordering::SeqCst));
    assert!(stream.query());
}
test_device!(synchronize_waits_for_the_stream);

fn device_synchronize_waits_for_every_stream(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let streams: Vec<Stream> = (0..3).map(|_| new_stream(ctx)).collect();
    let flags: Vec<Arc<AtomicBool>> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
    for (stream, flag) in streams.iter().zip(&flags) {
        let flag = Arc::clone(flag);
        stream
            .launch(Box::new(move || {
                thread::sleep(Duration::from_millis(30));
                flag.store(true, Ordering::SeqCst);
                Ok(())
            }))
            .unwrap();
    }
    ctx.synchronize().unwrap();
    assert!(flags.iter().all(|f| f.load(Ordering::SeqCst)));
    assert!(streams.iter().all(Stream::query));
}
test_device!(device_synchronize_waits_for_every_stream);

fn device_synchronize_waits_for_work_on_dropped_streams(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let done = Arc::new(AtomicBool::new(false));
    {
        let stream = new_stream(ctx);
        stream.launch(sleep_kernel(100)).unwrap();
        let flag = Arc::clone(&done);
        stream
            .launch(Box::new(move || {
                flag.store(true, Ordering::SeqCst);
                Ok(())
            }))
            .unwrap();
        stream
            .launch(Box::new(|| Err(AsyncError::new(ErrorKind::Device, "failed after its stream was dropped"))))
            .unwrap();
    } // the only handle goes; the queued work keeps running (as after cudaStreamDestroy)
    let outcome = ctx.synchronize();
    assert!(done.load(Ordering::SeqCst), "the dropped stream's work finished first");
    // Its asynchronous error is not lost either.
    match outcome {
        Err(Error::Async { error, .. }) => assert_eq!(error.message(), "failed after its stream was dropped"),
        other => panic!("expected the dropped stream's error, got {other:?}"),
    }
    ctx.synchronize().unwrap();
}
test_device!(device_synchronize_waits_for_work_on_dropped_streams);

fn events_recorded_on_a_dropped_busy_stream_complete_after_its_work(ctx: &'static Arc<DeviceContext>) {
    // What the pool does when a block a dropped stream used is freed: it records where that
    // stream's work ends. The stream is closed (its worker leaves once the queue is empty), so
    // the record carries no job, yet must complete exactly when the queued work is done.
    let (release, blocker) = gate();
    let done = Arc::new(AtomicBool::new(false));
    let usage = {
        let stream = new_stream(ctx);
        stream.launch(blocker).unwrap();
        let flag = Arc::clone(&done);
        stream
            .launch(Box::new(move || {
                flag.store(true, Ordering::SeqCst);
                Ok(())
            }))
            .unwrap();
        stream.usage()
    };
    assert!(usage.may_be_busy(), "the registry keeps a dropped stream while its work is queued");
    let pending = usage.record_new_event(ctx.device().as_ref()).unwrap().expect("an event on the busy stream");
    thread::sleep(Duration::from_millis(20));
    assert!(!pending.query(), "recorded behind the blocked work");
    release.send(()).unwrap();
    pending.synchronize().unwrap();
    assert!(done.load(Ordering::SeqCst), "the event completed only after the queued work");
    // Recorded once the work is done: complete at once.
    if let Some(after) = usage.record_new_event(ctx.device().as_ref()).unwrap() {
        after.synchronize().unwrap();
        assert!(after.query());
    }
    ctx.synchronize().unwrap();
}
test_device!(events_recorded_on_a_dropped_busy_stream_complete_after_its_work);

fn kernel_errors_surface_at_the_next_synchronize(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = new_stream(ctx);
    let log = new_log();
    stream.launch(Box::new(|| Err(AsyncError::new(ErrorKind::Device, "boom")))).unwrap();
    stream.launch(push(&log, 1)).unwrap();
    match stream.synchronize() {
        Err(Error::Async { stream: name, error }) => {
            assert_eq!(error.message(), "boom");
            assert_eq!(error.kind(), ErrorKind::Device);
            assert!(name.starts_with("opbridge-cpu-stream"), "{name}");
        }
        other => panic!("expected an async error, got {other:?}"),
    }
    assert_eq!(logged(&log), [1], "later work still ran");
    stream.synchronize().expect("an error is reported once");

    // A panicking kernel is an error too, and does not kill the stream's worker.
    stream.launch(Box::new(|| panic!("kernel bug (expected by this test)"))).unwrap();
    stream.launch(push(&log, 2)).unwrap();
    match stream.synchronize() {
        Err(Error::Async { error, .. }) => {
            assert_eq!(error.message(), "kernel panicked");
            assert_eq!(error.kind(), ErrorKind::Internal);
        }
        other => panic!("expected an async error, got {other:?}"),
    }
    stream.launch(push(&log, 3)).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(logged(&log), [1, 2, 3]);

    // Only the first error since the last synchronize is kept.
    stream.launch(Box::new(|| Err(AsyncError::new(ErrorKind::Device, "first")))).unwrap();
    stream.launch(Box::new(|| Err(AsyncError::new(ErrorKind::Device, "second")))).unwrap();
    assert!(matches!(stream.synchronize(), Err(Error::Async { error, .. }) if error.message() == "first"));
    stream.synchronize().unwrap();
}
test_device!(kernel_errors_surface_at_the_next_synchronize);

fn device_synchronize_reports_a_stream_error_once(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (ok, failing) = (new_stream(ctx), new_stream(ctx));
    ok.launch(sleep_kernel(5)).unwrap();
    failing.launch(Box::new(|| Err(AsyncError::new(ErrorKind::Device, "late failure")))).unwrap();
    match ctx.synchronize() {
        Err(Error::Async { error, .. }) => assert_eq!(error.message(), "late failure"),
        other => panic!("expected an async error, got {other:?}"),
    }
    failing.synchronize().expect("already reported by the device synchronize");
    ctx.synchronize().unwrap();
    let log = new_log();
    failing.launch(push(&log, "still works")).unwrap();
    failing.synchronize().unwrap();
    assert_eq!(logged(&log), ["still works"]);
}
test_device!(device_synchronize_reports_a_stream_error_once);

fn events_complete_in_stream_order_and_time_the_work_between(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = new_stream(ctx);
    let start = stream.record_new_event().unwrap();
    stream.launch(sleep_kernel(20)).unwrap();
    let end = Event::new(ctx).unwrap();
    assert_eq!(end.device(), DeviceId::CPU);
    end.record(&stream).unwrap();
    end.synchronize().unwrap();
    assert!(start.query() && end.query());
    let ms = start.elapsed_ms(&end).unwrap();
    assert!(ms >= 19.999, "elapsed {ms} ms across a 20 ms kernel");
    let back = end.elapsed_ms(&start).unwrap();
    assert!(back <= -19.999, "signed like cudaEventElapsedTime: {back}");
}
test_device!(events_complete_in_stream_order_and_time_the_work_between);

fn event_query_follows_the_stream(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = new_stream(ctx);
    let (release, blocked) = gate();
    stream.launch(blocked).unwrap();
    let event = stream.record_new_event().unwrap();
    assert!(!event.query(), "the stream has not reached the event");
    assert!(format!("{event:?}").contains("done=false"));
    release.send(()).unwrap();
    event.synchronize().unwrap();
    assert!(event.query());
}
test_device!(event_query_follows_the_stream);

fn elapsed_time_needs_two_completed_events(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = new_stream(ctx);
    let never = Event::new(ctx).unwrap();
    assert!(never.query(), "an unrecorded event counts as complete");
    never.synchronize().unwrap();
    let recorded = stream.record_new_event().unwrap();
    recorded.synchronize().unwrap();
    assert!(matches!(never.elapsed_ms(&recorded), Err(Error::Device { .. })));
    assert!(matches!(recorded.elapsed_ms(&never), Err(Error::Device { .. })));

    // Recorded but not reached yet: also an error, not a made-up figure.
    let (release, blocked) = gate();
    stream.launch(blocked).unwrap();
    let pending = stream.record_new_event().unwrap();
    assert!(matches!(recorded.elapsed_ms(&pending), Err(Error::Device { .. })));
    release.send(()).unwrap();
    pending.synchronize().unwrap();
    assert!(recorded.elapsed_ms(&pending).unwrap() >= 0.0);
}
test_device!(elapsed_time_needs_two_completed_events);

fn re_recording_an_event_moves_it(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (busy, idle) = (new_stream(ctx), new_stream(ctx));
    let (release, blocked) = gate();
    busy.launch(blocked).unwrap();
    let event = busy.record_new_event().unwrap();
    assert!(!event.query());
    event.record(&idle).unwrap();
    idle.synchronize().unwrap();
    assert!(event.query(), "the event now marks the idle stream's point");
    release.send(()).unwrap();
    busy.synchronize().unwrap();
    assert!(event.query());
}
test_device!(re_recording_an_event_moves_it);

fn wait_event_orders_work_across_streams(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (a, b) = (new_stream(ctx), new_stream(ctx));
    let log = new_log();
    let (release, blocked) = gate();
    a.launch(blocked).unwrap();
    a.launch(push(&log, "a")).unwrap();
    let a_done = a.record_new_event().unwrap();
    b.wait_event(&a_done).unwrap();
    b.launch(push(&log, "b")).unwrap();
    assert!(!b.query(), "B waits for A");
    assert!(logged(&log).is_empty());
    release.send(()).unwrap();
    b.synchronize().unwrap();
    assert_eq!(logged(&log), ["a", "b"]);

    // Waiting on an event that was never recorded does not block.
    let c = new_stream(ctx);
    c.wait_event(&Event::new(ctx).unwrap()).unwrap();
    c.launch(push(&log, "c")).unwrap();
    c.synchronize().unwrap();
    assert_eq!(logged(&log), ["a", "b", "c"]);
}
test_device!(wait_event_orders_work_across_streams);

/// Writes `values` to the f32s at `ptr`.
///
/// # Safety
/// `ptr` must be the 4-byte-aligned address of at least `values.len()` f32s of host memory
/// that nothing else reads or writes during the call.
unsafe fn write_f32s(ptr: DevicePtr, values: &[f32]) {
    // SAFETY: the caller's obligations.
    unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), ptr.0 as *mut f32, values.len()) }
}

/// Reads `n` f32s at `ptr`.
///
/// # Safety
/// `ptr` must be the 4-byte-aligned address of at least `n` initialized f32s of host memory
/// that nothing writes during the call.
unsafe fn read_f32s(ptr: DevicePtr, n: usize) -> Vec<f32> {
    // SAFETY: the caller's obligations.
    unsafe { std::slice::from_raw_parts(ptr.0 as *const f32, n).to_vec() }
}

fn tensor_read_on_another_stream_sees_the_write(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (a, b) = (new_stream(ctx), new_stream(ctx));
    const N: usize = 1024;
    let tensor = Tensor::empty(ctx, &[N], DType::F32, a.id()).unwrap();
    assert_eq!(tensor.nbytes(), N * 4);
    let ptr = tensor.data_ptr();
    // Zero it first, so a read that ran too early would see zeros, not uninitialized memory.
    Tensor::launch(
        &a,
        &[],
        &[&tensor],
        Box::new(move || {
            // SAFETY: `tensor` (kept alive until the streams are synchronized) owns N f32s of
            // host memory at `ptr`, and Tensor::launch orders every access to it.
            unsafe { write_f32s(ptr, &[0.0; N]) };
            Ok(())
        }),
    )
    .unwrap();
    a.synchronize().unwrap();

    let expected: Vec<f32> = (0..N).map(|i| i as f32 * 1.5).collect();
    let values = expected.clone();
    let log = new_log();
    let (release, gate_rx) = mpsc::channel::<()>();
    let write_log = Arc::clone(&log);
    Tensor::launch(
        &a,
        &[],
        &[&tensor],
        Box::new(move || {
            let _ = gate_rx.recv(); // a slow writer
                                    // SAFETY: as above.
            unsafe { write_f32s(ptr, &values) };
            write_log.lock().unwrap().push("write");
            Ok(())
        }),
    )
    .unwrap();
    let seen: Log<f32> = new_log();
    let (read_log, read_seen) = (Arc::clone(&log), Arc::clone(&seen));
    Tensor::launch(
        &b,
        &[&tensor],
        &[],
        Box::new(move || {
            // SAFETY: as above; the tensor was zeroed, so all N f32s are initialized.
            let values = unsafe { read_f32s(ptr, N) };
            read_seen.lock().unwrap().extend(values);
            read_log.lock().unwrap().push("read");
            Ok(())
        }),
    )
    .unwrap();
    assert!(!b.query(), "the read on B waits for the write on A");
    release.send(()).unwrap();
    b.synchronize().unwrap();
    assert_eq!(logged(&log), ["write", "read"]);
    assert_eq!(logged(&seen), expected);
    tensor.wait_idle().unwrap();
}
test_device!(tensor_read_on_another_stream_sees_the_write);

/// Tensors remember where their work ends as marks, made into events only when waited on
/// (see `Mark`). A host function (or a wait for another stream) queued after the work must not
/// become part of what a later wait covers: it may itself wait for the thread that waits.
fn marks_are_sealed_before_host_functions_and_stream_waits(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (s, x) = (new_stream(ctx), new_stream(ctx));
    let tensor = Arc::new(Tensor::empty(ctx, &[4], DType::F32, s.id()).unwrap());
    Tensor::launch(&s, &[], &[&tensor], Box::new(|| Ok(()))).unwrap();
    // After the write: a host function that waits until the write has been seen from the host.
    let (release, blocked) = gate();
    s.launch_host_func(blocked).unwrap();
    let reader = Arc::clone(&tensor);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(reader.wait_ready());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the host read waited for the host function queued after the write")
        .unwrap();
    release.send(()).unwrap();
    s.synchronize().unwrap();

    // The same for a wait on another stream's event that is held up on the host.
    let written = Arc::new(Tensor::empty(ctx, &[4], DType::F32, s.id()).unwrap());
    let (release_x, blocked_x) = gate();
    x.launch_host_func(blocked_x).unwrap();
    let after_x = x.record_new_event().unwrap();
    Tensor::launch(&s, &[], &[&written], Box::new(|| Ok(()))).unwrap();
    s.wait_event(&after_x).unwrap();
    let reader = Arc::clone(&written);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(reader.wait_ready());
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("the host read waited for the other stream").unwrap();
    assert!(!s.query(), "s still waits for x");
    release_x.send(()).unwrap();
    s.synchronize().unwrap();
    x.synchronize().unwrap();
}
test_device!(marks_are_sealed_before_host_functions_and_stream_waits);

/// A mark outlives its stream: dropping the stream seals it, and waiting on it still works.
fn marks_of_a_dropped_stream_still_wait_for_its_work(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let s = new_stream(ctx);
    let tensor = Tensor::empty(ctx, &[4], DType::F32, s.id()).unwrap();
    let (release, blocked) = gate();
    Tensor::launch(&s, &[], &[&tensor], blocked).unwrap();
    let done = s.mark().unwrap();
    drop(s);
    assert!(!done.query() && !tensor.is_ready(), "the dropped stream's work is still queued");
    release.send(()).unwrap();
    done.synchronize().unwrap();
    tensor.wait_ready().unwrap();
    assert!(done.query() && done.known_done() && tensor.is_ready());
}
test_device!(marks_of_a_dropped_stream_still_wait_for_its_work);

fn tensor_write_waits_for_reads_and_writes_on_other_streams(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (a, b, c) = (new_stream(ctx), new_stream(ctx), new_stream(ctx));
    let tensor = Tensor::empty(ctx, &[16], DType::I32, a.id()).unwrap();
    let log = new_log();

    // Write after read: a write on C waits for a slow read on B.
    let (release, blocked) = gate();
    Tensor::launch(&b, &[&tensor], &[], blocked).unwrap();
    Tensor::launch(&b, &[&tensor], &[], push(&log, "read on b")).unwrap();
    Tensor::launch(&c, &[], &[&tensor], push(&log, "write on c")).unwrap();
    assert!(!c.query(), "the write waits for the read");
    release.send(()).unwrap();
    c.synchronize().unwrap();
    assert_eq!(logged(&log), ["read on b", "write on c"]);

    // Write after write: a write on A waits for a slow write on C.
    let (release, blocked) = gate();
    Tensor::launch(&c, &[], &[&tensor], blocked).unwrap();
    Tensor::launch(&c, &[], &[&tensor], push(&log, "write on c")).unwrap();
    Tensor::launch(&a, &[], &[&tensor], push(&log, "write on a")).unwrap();
    assert!(!a.query());
    release.send(()).unwrap();
    a.synchronize().unwrap();
    assert_eq!(logged(&log)[2..], ["write on c", "write on a"]);

    // Reads on two streams do not wait for each other.
    let (release, blocked) = gate();
    Tensor::launch(&b, &[&tensor], &[], blocked).unwrap();
    Tensor::launch(&c, &[&tensor], &[], push(&log, "read on c")).unwrap();
    // Should the read on C wrongly wait for B, this watchdog ends the wait (and the test fails
    // below) instead of letting it hang.
    let watchdog = release.clone();
    thread::spawn(move || {
        thread::sleep(Duration::from_secs(5));
        let _ = watchdog.send(());
    });
    c.synchronize().unwrap(); // returns although the read on B is still blocked
    assert!(!b.query(), "the read on C did not wait for the read on B");
    release.send(()).unwrap();
    b.synchronize().unwrap();
    assert_eq!(logged(&log).last(), Some(&"read on c"));
}
test_device!(tensor_write_waits_for_reads_and_writes_on_other_streams);

fn tensor_wait_ready_and_wait_idle_block_the_host(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = new_stream(ctx);
    let tensor = Tensor::empty(ctx, &[4, 4], DType::F64, stream.id()).unwrap();
    assert!(tensor.is_contiguous());
    let log = new_log();
    let writer = Arc::clone(&log);
    Tensor::launch(
        &stream,
        &[],
        &[&tensor],
        Box::new(move || {
            thread::sleep(Duration::from_millis(30));
            writer.lock().unwrap().push("written");
            Ok(())
        }),
    )
    .unwrap();
    tensor.wait_ready().unwrap();
    assert_eq!(logged(&log), ["written"], "wait_ready returns after the write");

    let reader = new_stream(ctx);
    let read_log = Arc::clone(&log);
    Tensor::launch(
        &reader,
        &[&tensor],
        &[],
        Box::new(move || {
            thread::sleep(Duration::from_millis(30));
            read_log.lock().unwrap().push("read");
            Ok(())
        }),
    )
    .unwrap();
    tensor.wait_idle().unwrap();
    assert_eq!(logged(&log), ["written", "read"], "wait_idle returns after the read");
}
test_device!(tensor_wait_ready_and_wait_idle_block_the_host);

fn tensor_launch_makes_the_pool_wait_for_other_streams(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (a, b) = (new_stream(ctx), new_stream(ctx));
    // Blocks of earlier tests may still wait for their streams: let them finish first.
    ctx.synchronize().unwrap();
    assert_eq!(ctx.pool().stats().pending_free_blocks, 0);
    let tensor = Tensor::empty(ctx, &[1000], DType::F32, a.id()).unwrap();
    let ptr = tensor.data_ptr();
    let (release, blocked) = gate();
    Tensor::launch(&b, &[&tensor], &[], blocked).unwrap(); // no record_stream needed
    drop(tensor);
    assert_eq!(ctx.pool().stats().pending_free_blocks, 1);
    let other = Tensor::empty(ctx, &[1000], DType::F32, a.id()).unwrap();
    assert_ne!(other.data_ptr(), ptr, "B may still read the old block");
    release.send(()).unwrap();
    b.synchronize().unwrap();
    assert_eq!(ctx.pool().stats().pending_free_blocks, 0);
    // `other` stays live, so the only candidate of this size is the block B released.
    let again = Tensor::empty(ctx, &[1000], DType::F32, a.id()).unwrap();
    assert_eq!(again.data_ptr(), ptr, "reused once B is done");
    drop(other);
}
test_device!(tensor_launch_makes_the_pool_wait_for_other_streams);

/// The chunk kernel of an f32 elementwise add.
fn add_f32(inputs: &[DevicePtr], out: DevicePtr, n: usize) -> HostFn {
    let (a, b) = (inputs[0], inputs[1]);
    Box::new(move || {
        // SAFETY: on the CPU device, device pointers are host addresses. The pipeline passes
        // two input blocks and an output block of at least `n` f32s each (64-byte aligned,
        // pool-owned for the whole run), and orders this kernel after the copies into the
        // inputs and before the copy out of the output; the three blocks are distinct.
        let (a, b, out) = unsafe {
            (
                std::slice::from_raw_parts(a.0 as *const f32, n),
                std::slice::from_raw_parts(b.0 as *const f32, n),
                std::slice::from_raw_parts_mut(out.0 as *mut f32, n),
            )
        };
        for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
            *o = x + y;
        }
        Ok(())
    })
}

fn to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

fn from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
}

/// Runs the staged add of `a` and `b` in chunks of `chunk` elements.
fn staged_add(
    ctx: &DeviceContext,
    a: &[f32],
    b: &[f32],
    chunk: usize,
) -> (opbridge_runtime::Result<PipelineReport>, Vec<f32>) {
    let (a_bytes, b_bytes) = (to_bytes(a), to_bytes(b));
    let mut out = vec![0u8; a.len() * 4];
    let report = staged_map(ctx, &[&a_bytes, &b_bytes], &[4, 4], &mut out, 4, a.len(), chunk, &add_f32);
    (report, from_bytes(&out))
}

fn staged_map_adds_two_f32_arrays(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    ctx.synchronize().unwrap();
    let (device, pinned) = (ctx.pool().stats(), ctx.pinned_pool().stats());

    const N: usize = 100_003;
    let a: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..N).map(|i| 0.25 * (i % 1000) as f32 - 7.0).collect();
    let expected: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let (report, sum) = staged_add(ctx, &a, &b, 4096);
    let report = report.unwrap();
    assert_eq!(sum, expected);
    assert_eq!(report, PipelineReport { chunks: N.div_ceil(4096), bytes_in: 2 * N * 4, bytes_out: N * 4 });
    assert_eq!(report.chunks, 25);

    // Its staging and device blocks go back to the pools once the pipeline streams are done.
    ctx.synchronize().unwrap();
    let (device_after, pinned_after) = (ctx.pool().stats(), ctx.pinned_pool().stats());
    assert_eq!(device_after.allocated_bytes_current, device.allocated_bytes_current);
    assert_eq!(device_after.allocated_blocks, device.allocated_blocks);
    assert_eq!(device_after.pending_free_blocks, 0);
    assert_eq!(pinned_after.allocated_bytes_current, pinned.allocated_bytes_current);
    assert_eq!(pinned_after.pending_free_blocks, 0);

    // A second run is served from the cache.
    let (report, sum) = staged_add(ctx, &b, &a, 4096);
    assert_eq!(report.unwrap().chunks, 25);
    assert_eq!(sum, expected);
    ctx.synchronize().unwrap();
    let device_again = ctx.pool().stats();
    assert_eq!(device_again.reserved_bytes_current, device_after.reserved_bytes_current, "no new segment");
    assert!(device_again.num_cache_hits > device_after.num_cache_hits);
    assert_eq!(device_again.allocated_bytes_current, device.allocated_bytes_current);
    assert_eq!(ctx.pinned_pool().stats().allocated_bytes_current, pinned.allocated_bytes_current);
}
test_device!(staged_map_adds_two_f32_arrays);

fn staged_map_handles_short_and_empty_inputs(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
    let b = [0.5f32; 10];
    let (report, sum) = staged_add(ctx, &a, &b, 3);
    assert_eq!(report.unwrap(), PipelineReport { chunks: 4, bytes_in: 80, bytes_out: 40 });
    assert_eq!(sum, a.iter().map(|x| x + 0.5).collect::<Vec<_>>());

    let (report, sum) = staged_add(ctx, &a, &b, 1 << 20);
    assert_eq!(report.unwrap().chunks, 1, "one chunk when it is larger than the input");
    assert_eq!(sum[9], 10.5);

    let (report, sum) = staged_add(ctx, &[], &[], 4096);
    assert_eq!(report.unwrap(), PipelineReport::default());
    assert!(sum.is_empty());
    ctx.synchronize().unwrap();
}
test_device!(staged_map_handles_short_and_empty_inputs);

fn staged_map_reports_a_failing_kernel(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let input = to_bytes(&[1.0; 100]);
    let mut out = vec![0u8; 400];
    let failing = |_: &[DevicePtr], _: DevicePtr, _: usize| -> HostFn {
        Box::new(|| Err(AsyncError::new(ErrorKind::Device, "chunk kernel failed")))
    };
    match staged_map(ctx, &[&input], &[4], &mut out, 4, 100, 32, &failing) {
        Err(Error::Async { error, .. }) => assert_eq!(error.message(), "chunk kernel failed"),
        other => panic!("expected the kernel's error, got {other:?}"),
    }
    ctx.synchronize().unwrap();
    // The pipeline streams keep working.
    let (report, sum) = staged_add(ctx, &[1.0, 2.0], &[3.0, 4.0], 1);
    assert_eq!(report.unwrap().chunks, 2);
    assert_eq!(sum, [4.0, 6.0]);
    ctx.synchronize().unwrap();
}
test_device!(staged_map_reports_a_failing_kernel);

// --- dropped streams release their workers ------------------------------------------------------

/// Threads of this process (Linux: the entries of /proc/self/task).
fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

/// Waits (up to 10 s) for the thread count to come back to at most `limit`; returns the last count.
fn threads_settle_to(limit: usize) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = thread_count();
        if now <= limit || std::time::Instant::now() > deadline {
            return now;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

fn noop() -> HostFn {
    Box::new(|| Ok(()))
}

fn dropped_streams_release_their_workers_while_a_block_they_used_lives(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    if thread_count() == 0 {
        return; // no /proc: nothing to count with
    }
    let tensor = Tensor::empty(ctx, &[1024], DType::F32, StreamId::HOST).unwrap();
    let before = thread_count();
    for i in 0..300 {
        let stream = new_stream(ctx);
        Tensor::launch(&stream, &[&tensor], &[], noop()).unwrap();
        if i % 2 == 0 {
            stream.synchronize().unwrap(); // dropped idle
        } // else dropped with the work maybe still queued (retired)
    }
    ctx.synchronize().unwrap();
    new_stream(ctx); // lets the registry forget retired streams that have finished since
    let after = threads_settle_to(before + 8);
    assert!(after <= before + 8, "300 dropped streams left {} threads behind", after - before);
    // The block still waits for a stream that is alive and busy before it is reused.
    let busy = new_stream(ctx);
    let (release, blocked) = gate();
    Tensor::launch(&busy, &[&tensor], &[], blocked).unwrap();
    drop(tensor);
    assert_eq!(ctx.pool().stats().pending_free_blocks, 1, "the freed block waits for the busy stream");
    release.send(()).unwrap();
    busy.synchronize().unwrap();
    ctx.pool().empty_cache().unwrap();
    assert_eq!(ctx.pool().stats().pending_free_blocks, 0);
}
test_device!(dropped_streams_release_their_workers_while_a_block_they_used_lives);

fn short_lived_threads_using_a_long_lived_tensor_leave_no_workers(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    if thread_count() == 0 {
        return;
    }
    let tensor = Arc::new(Tensor::empty(ctx, &[1024], DType::F32, StreamId::HOST).unwrap());
    let before = thread_count();
    for _ in 0..200 {
        let tensor = Arc::clone(&tensor);
        // Each thread's current stream is made on first use and dropped when the thread ends.
        thread::spawn(move || {
            let stream = current_stream(ctx).unwrap();
            Tensor::launch(&stream, &[&tensor], &[], sleep_kernel(1)).unwrap();
        })
        .join()
        .unwrap();
    }
    ctx.synchronize().unwrap();
    new_stream(ctx);
    let after = threads_settle_to(before + 8);
    assert!(after <= before + 8, "200 finished threads left {} stream workers behind", after - before);
    drop(tensor);
}
test_device!(short_lived_threads_using_a_long_lived_tensor_leave_no_workers);

// --- waits from a host function that could only end after it ------------------------------------

/// Runs `probe` as a host function on `stream` and returns its result; fails the test (instead
/// of hanging it) when the probe does not return within 10 s.
fn from_host_function(
    stream: &Stream,
    probe: impl FnOnce() -> opbridge_runtime::Result<()> + Send + 'static,
) -> opbridge_runtime::Result<()> {
    let (tx, rx) = mpsc::channel();
    stream
        .launch_host_func(Box::new(move || {
            let _ = tx.send(probe());
            Ok(())
        }))
        .unwrap();
    rx.recv_timeout(Duration::from_secs(10)).expect("the wait hung instead of failing")
}

fn assert_refused(outcome: opbridge_runtime::Result<()>, case: &str) {
    match outcome {
        Err(e @ Error::Device { .. }) => {
            assert_eq!(e.kind(), ErrorKind::Device);
            assert!(e.to_string().contains("from work running on"), "{case}: {e}");
        }
        other => panic!("{case}: expected a Device error, got {other:?}"),
    }
}

fn host_function_waits_that_need_its_own_stream_fail(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let s = new_stream(ctx);

    // An event recorded on its own stream (after itself) and synchronized.
    let me = s.clone();
    assert_refused(from_host_function(&s, move || me.record_new_event()?.synchronize()), "own event");

    // A tensor whose writer is queued behind the host function.
    let (release, blocked) = gate();
    s.launch(blocked).unwrap();
    let tensor = Arc::new(Tensor::empty(ctx, &[4], DType::F32, StreamId::HOST).unwrap());
    let (tx, rx) = mpsc::channel();
    let read = Arc::clone(&tensor);
    s.launch_host_func(Box::new(move || {
        let _ = tx.send(read.wait_ready());
        Ok(())
    }))
    .unwrap();
    Tensor::launch(&s, &[], &[&tensor], noop()).unwrap();
    release.send(()).unwrap();
    assert_refused(rx.recv_timeout(Duration::from_secs(10)).expect("hung"), "tensor written after it");

    // A stream that waits for work after it; and one that waits for that one (transitively).
    let t = new_stream(ctx);
    let u = new_stream(ctx);
    let (release, blocked) = gate();
    s.launch(blocked).unwrap();
    let (tx, rx) = mpsc::channel();
    let (t2, u2) = (t.clone(), u.clone());
    s.launch_host_func(Box::new(move || {
        let _ = tx.send((t2.synchronize(), u2.synchronize()));
        Ok(())
    }))
    .unwrap();
    t.wait_event(&s.record_new_event().unwrap()).unwrap();
    u.wait_event(&t.record_new_event().unwrap()).unwrap();
    release.send(()).unwrap();
    let (on_t, on_u) = rx.recv_timeout(Duration::from_secs(10)).expect("hung");
    assert_refused(on_t, "stream waiting on it");
    assert_refused(on_u, "stream waiting on a stream waiting on it");

    // The device's synchronize includes its own stream.
    assert_refused(from_host_function(&s, move || ctx.synchronize()), "device synchronize");
    s.synchronize().unwrap();
    t.synchronize().unwrap();
    u.synchronize().unwrap();
}
test_device!(host_function_waits_that_need_its_own_stream_fail);

fn two_host_functions_waiting_for_each_other_fail_instead_of_hanging(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (s, x) = (new_stream(ctx), new_stream(ctx));
    let (release, blocked) = gate();
    s.launch(blocked).unwrap();
    // On x: a host function that waits for s past the host function queued next on s.
    let after_s = Event::new(ctx).unwrap();
    let (tx_x, rx_x) = mpsc::channel();
    let (started_tx, started) = mpsc::channel();
    let (go, recorded) = mpsc::channel::<()>();
    let wait_s = after_s.clone();
    x.launch_host_func(Box::new(move || {
        // Not before `after_s` is recorded: a never-recorded event counts as complete.
        let _ = recorded.recv();
        let _ = started_tx.send(());
        let _ = tx_x.send(wait_s.synchronize());
        Ok(())
    }))
    .unwrap();
    let after_x = x.record_new_event().unwrap();
    // On s: a host function that waits for x past the first one.
    let (tx_s, rx_s) = mpsc::channel();
    s.launch_host_func(Box::new(move || {
        let _ = tx_s.send(after_x.synchronize());
        Ok(())
    }))
    .unwrap();
    after_s.record(&s).unwrap();
    go.send(()).unwrap();
    // x's host function is running (a loaded machine may take long to start it), then blocked
    // waiting shortly after.
    started.recv_timeout(Duration::from_secs(10)).expect("x's host function never ran");
    thread::sleep(Duration::from_millis(50));
    release.send(()).unwrap();
    assert_refused(rx_s.recv_timeout(Duration::from_secs(10)).expect("hung"), "a wait cycle through another worker");
    rx_x.recv_timeout(Duration::from_secs(10)).expect("hung").expect("x's wait ends once s moves on");
    s.synchronize().unwrap();
    x.synchronize().unwrap();
}
test_device!(two_host_functions_waiting_for_each_other_fail_instead_of_hanging);

fn host_function_waits_that_can_end_still_wait(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let (s, x) = (new_stream(ctx), new_stream(ctx));
    // x: slow work, an event, then a wait for s's work after the host function (ping-pong).
    x.launch(sleep_kernel(50)).unwrap();
    let done_x = x.record_new_event().unwrap();
    let log = new_log();
    let (log2, x2) = (Arc::clone(&log), x.clone());
    let outcome = {
        let (tx, rx) = mpsc::channel();
        s.launch_host_func(Box::new(move || {
            // The event before x's wait for s: reachable, so it waits.
            let first = done_x.synchronize();
            log2.lock().unwrap().push("event");
            let _ = tx.send(first);
            Ok(())
        }))
        .unwrap();
        x2.wait_event(&s.record_new_event().unwrap()).unwrap();
        rx.recv_timeout(Duration::from_secs(10)).expect("hung")
    };
    outcome.expect("an event queued before the cross wait is reachable");
    assert_eq!(logged(&log), vec!["event"]);
    // A host function synchronizing an independent busy stream waits for it.
    let y = new_stream(ctx);
    y.launch(sleep_kernel(30)).unwrap();
    let y2 = y.clone();
    from_host_function(&s, move || y2.synchronize()).expect("an independent stream can be waited for");
    assert!(y.query());
    s.synchronize().unwrap();
    x.synchronize().unwrap();
}
test_device!(host_function_waits_that_can_end_still_wait);

// --- `with stream:` blocks exited in any order -----------------------------------------------------

fn stream_contexts_exited_out_of_order_leave_the_right_stream(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    thread::spawn(move || {
        let default = current_stream(ctx).unwrap();
        let (s1, s2, s3) = (new_stream(ctx), new_stream(ctx), new_stream(ctx));
        let c1 = opbridge_runtime::enter_stream(s1.clone());
        let c2 = opbridge_runtime::enter_stream(s2.clone());
        c1.exit(); // out of order: s2's block is still open
        assert_eq!(current_stream(ctx).unwrap(), s2);
        c2.exit();
        assert_eq!(current_stream(ctx).unwrap(), default, "nothing open: the stream from before");

        // Three deep, the middle one first, then the outer, then the inner.
        let c1 = opbridge_runtime::enter_stream(s1.clone());
        let c2 = opbridge_runtime::enter_stream(s2.clone());
        let c3 = opbridge_runtime::enter_stream(s3.clone());
        c2.exit();
        assert_eq!(current_stream(ctx).unwrap(), s3);
        c1.exit();
        assert_eq!(current_stream(ctx).unwrap(), s3);
        c3.exit();
        assert_eq!(current_stream(ctx).unwrap(), default);

        // set_current_stream inside a block is undone by the block's exit.
        let c1 = opbridge_runtime::enter_stream(s1.clone());
        assert_eq!(set_current_stream(s3.clone()), Some(s1.clone()));
        assert_eq!(current_stream(ctx).unwrap(), s3);
        c1.exit();
        assert_eq!(current_stream(ctx).unwrap(), default);

        // A block exited on another thread (a generator resumed elsewhere) is closed here too.
        let c1 = opbridge_runtime::enter_stream(s1.clone());
        let c2 = opbridge_runtime::enter_stream(s2.clone());
        thread::spawn(move || c2.exit()).join().unwrap();
        assert_eq!(current_stream(ctx).unwrap(), s1);
        c1.exit();
        assert_eq!(current_stream(ctx).unwrap(), default);
    })
    .join()
    .unwrap();
}
test_device!(stream_contexts_exited_out_of_order_leave_the_right_stream);
