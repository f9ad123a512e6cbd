//! Owned Rust mirror of ExecuTorch 1.5.1 `program.fbs` (namespace
//! `executorch_flatbuffer`). Field names and order follow the schema.
//!
//! Conventions: absent vectors and strings read as empty; absent tables that
//! carry meaning when missing are `Option`. `non_const_buffer_device` and
//! `stacktrace` stay `Option` because "absent" is what CPU-only / no-frames
//! programs write and the runtime distinguishes it from "empty".

use etmetal_core::DType;

/// Root table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    pub version: u32,
    pub execution_plan: Vec<ExecutionPlan>,
    /// Deprecated inline constants (files before ~v0.4); new files use `constant_segment`.
    pub constant_buffer: Vec<Buffer>,
    pub backend_delegate_data: Vec<BackendDelegateInlineData>,
    pub segments: Vec<DataSegment>,
    pub constant_segment: Option<SubsegmentOffsets>,
    pub mutable_data_segments: Vec<SubsegmentOffsets>,
    pub named_data: Vec<NamedData>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExecutionPlan {
    pub name: String,
    pub container_meta_type: Option<ContainerMetadata>,
    pub values: Vec<EValue>,
    pub inputs: Vec<i32>,
    pub outputs: Vec<i32>,
    pub chains: Vec<Chain>,
    pub operators: Vec<Operator>,
    pub delegates: Vec<BackendDelegate>,
    pub non_const_buffer_sizes: Vec<i64>,
    pub non_const_buffer_device: Option<Vec<NonConstBufferDevice>>,
}

/// Pytree specs of the flattened inputs and outputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContainerMetadata {
    pub encoded_inp_str: String,
    pub encoded_out_str: String,
}

/// `EValue { val: KernelTypes }`; the union member is the variant.
#[derive(Clone, Debug, PartialEq)]
pub enum EValue {
    Null,
    Int(i64),
    Bool(bool),
    Double(f64),
    Tensor(Tensor),
    String(String),
    IntList(Vec<i64>),
    DoubleList(Vec<f64>),
    BoolList(Vec<bool>),
    /// Value indices of the list's tensors.
    TensorList(Vec<i32>),
    /// Value indices; -1 stands for None.
    OptionalTensorList(Vec<i32>),
}

impl EValue {
    /// The `KernelTypes` union tag written in the flatbuffer.
    pub fn kernel_type(&self) -> u8 {
        match self {
            EValue::Null => 1,
            EValue::Int(_) => 2,
            EValue::Bool(_) => 3,
            EValue::Double(_) => 4,
            EValue::Tensor(_) => 5,
            EValue::String(_) => 6,
            EValue::IntList(_) => 7,
            EValue::DoubleList(_) => 8,
            EValue::BoolList(_) => 9,
            EValue::TensorList(_) => 10,
            EValue::OptionalTensorList(_) => 11,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub scalar_type: DType,
    pub storage_offset: i32,
    pub sizes: Vec<i32>,
    pub dim_order: Vec<u8>,
    pub requires_grad: bool,
    /// > 0: index into the constant (or mutable-data) offsets; 0: no stored data.
    pub data_buffer_idx: u32,
    pub allocation_info: Option<AllocationDetails>,
    pub layout: i8,
    pub shape_dynamism: TensorShapeDynamism,
    pub extra_tensor_info: Option<ExtraTensorInfo>,
}

impl Tensor {
    /// A static tensor in the default dim order: its data in the constant
    /// (or mutable-data) segment when `data_buffer_idx > 0`, and/or planned
    /// memory when `allocation_info` is given.
    pub fn contiguous(
        scalar_type: DType,
        sizes: Vec<i32>,
        data_buffer_idx: u32,
        allocation_info: Option<AllocationDetails>,
    ) -> Tensor {
        Tensor {
            scalar_type,
            storage_offset: 0,
            dim_order: (0..sizes.len() as u8).collect(),
            sizes,
            requires_grad: false,
            data_buffer_idx,
            allocation_info,
            layout: 0,
            shape_dynamism: TensorShapeDynamism::Static,
            extra_tensor_info: None,
        }
    }

    /// A static tensor at `offset` of planned memory `memory_id`.
    pub fn planned(scalar_type: DType, sizes: &[i32], memory_id: u32, offset: u64) -> Tensor {
        let details = AllocationDetails {
            memory_id,
            memory_offset_low: offset as u32,
            memory_offset_high: (offset >> 32) as u32,
        };
        Tensor::contiguous(scalar_type, sizes.to_vec(), 0, Some(details))
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocationDetails {
    pub memory_id: u32,
    pub memory_offset_low: u32,
    pub memory_offset_high: u32,
}

impl AllocationDetails {
    /// The 64-bit offset the schema splits into two 32-bit halves.
    pub fn memory_offset(&self) -> u64 {
        (u64::from(self.memory_offset_high) << 32) | u64::from(self.memory_offset_low)
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExtraTensorInfo {
    pub mutable_data_segments_idx: u64,
    pub fully_qualified_name: String,
    pub location: TensorDataLocation,
    pub device_type: DeviceType,
    pub device_index: i8,
}

/// Declares a `byte` enum of the schema with its numbering and a checked
/// conversion from the stored byte (unknown values are a format error).
macro_rules! schema_enum {
    ($(#[$m:meta])* $name:ident { $first:ident = $first_value:literal $(, $variant:ident = $value:literal)* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        #[repr(i8)]
        pub enum $name {
            #[default]
            $first = $first_value,
            $($variant = $value),*
        }

        impl $name {
            pub fn from_i8(value: i8) -> Option<$name> {
                match value {
                    $first_value => Some($name::$first),
                    $($value => Some($name::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

schema_enum!(TensorShapeDynamism { Static = 0, DynamicBound = 1, DynamicUnbound = 2 });
schema_enum!(TensorDataLocation { Segment = 0, External = 1 });
schema_enum!(DeviceType { Cpu = 0, Cuda = 1 });
schema_enum!(
    /// Where delegate data lives: `Program.backend_delegate_data` or `Program.segments`.
    DataLocation { Inline = 0, Segment = 1 }
);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Operator {
    pub name: String,
    pub overload: String,
}

impl Operator {
    /// The kernel registry key: `name.overload`, or `name` when the overload is empty.
    pub fn qualified_name(&self) -> String {
        if self.overload.is_empty() {
            self.name.clone()
        } else {
            format!("{}.{}", self.name, self.overload)
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelCall {
    pub op_index: i32,
    pub args: Vec<i32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DelegateCall {
    pub delegate_index: i32,
    pub args: Vec<i32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoveCall {
    pub move_from: i32,
    pub move_to: i32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JumpFalseCall {
    pub cond_value_index: i32,
    pub destination_instruction: i32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreeCall {
    pub value_index: i32,
}

/// `Instruction { instr_args: InstructionArguments }`; the union member is the variant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Instruction {
    KernelCall(KernelCall),
    DelegateCall(DelegateCall),
    MoveCall(MoveCall),
    JumpFalseCall(JumpFalseCall),
    FreeCall(FreeCall),
}

impl Instruction {
    /// The `InstructionArguments` union tag written in the flatbuffer.
    pub fn arguments_type(&self) -> u8 {
        match self {
            Instruction::KernelCall(_) => 1,
            Instruction::DelegateCall(_) => 2,
            Instruction::MoveCall(_) => 3,
            Instruction::JumpFalseCall(_) => 4,
            Instruction::FreeCall(_) => 5,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frame {
    pub filename: String,
    pub lineno: i32,
    pub name: String,
    pub context: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrameList {
    pub items: Vec<Frame>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendDelegateDataReference {
    pub location: DataLocation,
    pub index: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompileSpec {
    pub key: String,
    pub value: Vec<u8>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendDelegate {
    pub id: String,
    pub processed: BackendDelegateDataReference,
    pub compile_specs: Vec<CompileSpec>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chain {
    pub inputs: Vec<i32>,
    pub outputs: Vec<i32>,
    pub instructions: Vec<Instruction>,
    pub stacktrace: Option<Vec<FrameList>>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NonConstBufferDevice {
    pub buffer_idx: i32,
    pub device_type: DeviceType,
    pub device_index: i8,
}

/// Inline constant data (deprecated path); written 16-byte aligned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Buffer {
    pub storage: Vec<u8>,
}

/// Inline delegate payload; written 16-byte aligned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendDelegateInlineData {
    pub data: Vec<u8>,
}

/// A byte range after the program, relative to the header's `segment_base_offset`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataSegment {
    pub offset: u64,
    pub size: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SubsegmentOffsets {
    pub segment_index: u32,
    pub offsets: Vec<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamedData {
    pub key: String,
    pub segment_index: u32,
}
