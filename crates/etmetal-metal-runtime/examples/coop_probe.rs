//! Probe of wgpu's experimental cooperative-matrix support on this machine's
//! adapters: the configurations each reports, and whether a 16×16×16
//! f16×f16→f32 product (one subgroup, `coopMultiplyAdd`) validates, runs
//! and matches the CPU. Prints a line per adapter; exits 0 either way.

use wgpu::util::DeviceExt;

const N: usize = 16;

const KERNEL: &str = "enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read> a: array<f16>;
@group(0) @binding(1) var<storage, read> b: array<f16>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@compute @workgroup_size(32)
fn main() {
  let x = coopLoadT<coop_mat16x16<f16, A>>(&a[0], 16u);
  let y = coopLoadT<coop_mat16x16<f16, B>>(&b[0], 16u);
  var z = coop_mat16x16<f32, C>();
  z = coopMultiplyAdd(x, y, z);
  coopStoreT(z, &c[0], 16u);
}
";

fn main() {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    for adapter in adapters {
        let info = adapter.get_info();
        let props = adapter.cooperative_matrix_properties();
        let has = adapter
            .features()
            .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
        println!(
            "adapter {} ({:?}): feature {has}, f16 {}, configurations {props:?}",
            info.name,
            info.backend,
            adapter.features().contains(wgpu::Features::SHADER_F16)
        );
        if has && adapter.features().contains(wgpu::Features::SHADER_F16) {
            match run(&adapter) {
                Ok(err) => println!("  16x16x16 f16->f32: ran, max |gpu - cpu| = {err:e}"),
                Err(e) => println!("  16x16x16 f16->f32: failed: {e}"),
            }
        }
    }
}

fn run(adapter: &wgpu::Adapter) -> Result<f32, String> {
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: None,
        required_features: wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
            | wgpu::Features::SHADER_F16,
        required_limits: adapter.limits(),
        // SAFETY: a probe; the feature's shaders are validated by naga and
        // only read and write the buffers bound below.
        experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
        ..Default::default()
    }))
    .map_err(|e| e.to_string())?;
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: None,
        source: wgpu::ShaderSource::Wgsl(KERNEL.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: None,
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(format!("validation: {e:?}"));
    }
    // small integers: exact in f16 and in the f32 sums
    let av: Vec<f32> = (0..N * N).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    let bv: Vec<f32> = (0..N * N).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
    let half = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
            .collect()
    };
    let ab = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: &half(&av),
        usage: wgpu::BufferUsages::STORAGE,
    });
    let bb = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: &half(&bv),
        usage: wgpu::BufferUsages::STORAGE,
    });
    let size = (N * N * 4) as u64;
    let cb = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let rb = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: ab.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: bb.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 2,
                resource: cb.as_entire_binding(),
            },
        ],
    });
    let mut enc = device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    enc.copy_buffer_to_buffer(&cb, 0, &rb, 0, size);
    queue.submit([enc.finish()]);
    rb.map_async(wgpu::MapMode::Read, .., |_| {});
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| e.to_string())?;
    let view = rb.get_mapped_range(..).map_err(|e| e.to_string())?;
    let got: Vec<f32> = bytemuck_f32(&view);
    let mut err = 0f32;
    for i in 0..N {
        for j in 0..N {
            let want: f32 = (0..N).map(|k| av[i * N + k] * bv[k * N + j]).sum();
            err = err.max((got[i * N + j] - want).abs());
        }
    }
    Ok(err)
}

fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
