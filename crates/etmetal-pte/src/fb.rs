//! Hand-written flatbuffer bindings for `program.fbs` (Debian's flatc 2.0 is
//! too old for the flatbuffers 25 crate).
//!
//! Each table gets a marker type declared once with its fields, slots and
//! flatbuffer types; the same declaration produces both the `Verifiable`
//! impl and the accessors, so a reader can never follow a field with a type
//! other than the one that was verified. Slot `i` sits at vtable offset
//! `4 + 2*i`; a union takes two slots (tag, then value).
//!
//! `View`s exist only behind a verified buffer: they are built by `Follow`
//! (unsafe) from `root` below, which runs the verifier first.

use std::marker::PhantomData;

use flatbuffers::{
    ForwardsUOffset, InvalidFlatbuffer, Table, VOffsetT, Vector, Verifiable, Verifier,
    VerifierOptions,
};

/// A table of marker type `M` inside a verified buffer.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, M> {
    table: Table<'a>,
    marker: PhantomData<M>,
}

pub(crate) const fn slot(index: VOffsetT) -> VOffsetT {
    4 + 2 * index
}

pub(crate) type Str<'a> = ForwardsUOffset<&'a str>;
pub(crate) type Scalars<'a, S> = ForwardsUOffset<Vector<'a, S>>;
pub(crate) type Tables<'a, M> = ForwardsUOffset<Vector<'a, ForwardsUOffset<M>>>;
pub(crate) type Tab<M> = ForwardsUOffset<M>;

macro_rules! table {
    ($name:ident { $($field:ident @ $slot:literal : $ty:ty),* $(,)? }) => {
        pub(crate) struct $name;

        impl<'a> flatbuffers::Follow<'a> for $name {
            type Inner = View<'a, $name>;
            unsafe fn follow(buf: &'a [u8], loc: usize) -> Self::Inner {
                // SAFETY: forwarded contract of `Follow::follow`.
                View { table: unsafe { Table::new(buf, loc) }, marker: PhantomData }
            }
        }

        impl $name {
            // The unused lifetime lets field types name `'a` as the accessors do.
            #[allow(clippy::extra_unused_lifetimes)]
            fn verify_fields<'a>(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
                v.visit_table(pos)?
                    $(.visit_field::<$ty>(stringify!($field), slot($slot), false)?)*
                    .finish();
                Ok(())
            }
        }

        impl Verifiable for $name {
            fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
                $name::verify_fields(v, pos)
            }
        }

        impl<'a> View<'a, $name> {
            $(
                pub(crate) fn $field(&self) -> Option<<$ty as flatbuffers::Follow<'a>>::Inner> {
                    // SAFETY: the verifier checked this slot as `$ty`.
                    unsafe { self.table.get::<$ty>(slot($slot), None) }
                }
            )*
        }
    };
}

table!(ProgramT {
    version @0: u32,
    execution_plan @1: Tables<'a, ExecutionPlanT>,
    constant_buffer @2: Tables<'a, BufferT>,
    backend_delegate_data @3: Tables<'a, BackendDelegateInlineDataT>,
    segments @4: Tables<'a, DataSegmentT>,
    constant_segment @5: Tab<SubsegmentOffsetsT>,
    mutable_data_segments @6: Tables<'a, SubsegmentOffsetsT>,
    named_data @7: Tables<'a, NamedDataT>,
});
table!(ExecutionPlanT {
    name @0: Str<'a>,
    container_meta_type @1: Tab<ContainerMetadataT>,
    values @2: Tables<'a, EValueT>,
    inputs @3: Scalars<'a, i32>,
    outputs @4: Scalars<'a, i32>,
    chains @5: Tables<'a, ChainT>,
    operators @6: Tables<'a, OperatorT>,
    delegates @7: Tables<'a, BackendDelegateT>,
    non_const_buffer_sizes @8: Scalars<'a, i64>,
    non_const_buffer_device @9: Tables<'a, NonConstBufferDeviceT>,
});
table!(ContainerMetadataT { encoded_inp_str @0: Str<'a>, encoded_out_str @1: Str<'a> });
table!(NullT {});
table!(AllocationDetailsT { memory_id @0: u32, memory_offset_low @1: u32, memory_offset_high @2: u32 });
table!(ExtraTensorInfoT {
    mutable_data_segments_idx @0: u64,
    fully_qualified_name @1: Str<'a>,
    location @2: i8,
    device_type @3: i8,
    device_index @4: i8,
});
table!(TensorT {
    scalar_type @0: i8,
    storage_offset @1: i32,
    sizes @2: Scalars<'a, i32>,
    dim_order @3: Scalars<'a, u8>,
    requires_grad @4: bool,
    data_buffer_idx @5: u32,
    allocation_info @6: Tab<AllocationDetailsT>,
    layout @7: i8,
    shape_dynamism @8: i8,
    extra_tensor_info @9: Tab<ExtraTensorInfoT>,
});
table!(IntT { int_val @0: i64 });
table!(BoolT { bool_val @0: bool });
table!(DoubleT { double_val @0: f64 });
table!(StringT { string_val @0: Str<'a> });
table!(IntListT { items @0: Scalars<'a, i64> });
table!(DoubleListT { items @0: Scalars<'a, f64> });
table!(BoolListT { items @0: Scalars<'a, bool> });
table!(TensorListT { items @0: Scalars<'a, i32> });
table!(OptionalTensorListT { items @0: Scalars<'a, i32> });
table!(OperatorT { name @0: Str<'a>, overload @1: Str<'a> });
table!(KernelCallT { op_index @0: i32, args @1: Scalars<'a, i32> });
table!(DelegateCallT { delegate_index @0: i32, args @1: Scalars<'a, i32> });
table!(MoveCallT { move_from @0: i32, move_to @1: i32 });
table!(JumpFalseCallT { cond_value_index @0: i32, destination_instruction @1: i32 });
table!(FreeCallT { value_index @0: i32 });
table!(FrameT { filename @0: Str<'a>, lineno @1: i32, name @2: Str<'a>, context @3: Str<'a> });
table!(FrameListT { items @0: Tables<'a, FrameT> });
table!(BackendDelegateDataReferenceT { location @0: i8, index @1: u32 });
table!(CompileSpecT { key @0: Str<'a>, value @1: Scalars<'a, u8> });
table!(BackendDelegateT {
    id @0: Str<'a>,
    processed @1: Tab<BackendDelegateDataReferenceT>,
    compile_specs @2: Tables<'a, CompileSpecT>,
});
table!(ChainT {
    inputs @0: Scalars<'a, i32>,
    outputs @1: Scalars<'a, i32>,
    instructions @2: Tables<'a, InstructionT>,
    stacktrace @3: Tables<'a, FrameListT>,
});
table!(NonConstBufferDeviceT { buffer_idx @0: i32, device_type @1: i8, device_index @2: i8 });
table!(BufferT { storage @0: Scalars<'a, u8> });
table!(BackendDelegateInlineDataT { data @0: Scalars<'a, u8> });
table!(DataSegmentT { offset @0: u64, size @1: u64 });
table!(SubsegmentOffsetsT { segment_index @0: u32, offsets @1: Scalars<'a, u64> });
table!(NamedDataT { key @0: Str<'a>, segment_index @1: u32 });

/// Declares a table holding one union (tag at slot 0, value at slot 1): its
/// verifier checks the member table named by the tag, and `value()` returns
/// the member as an enum. Unknown tags pass the verifier (as flatc's code
/// does) and come back as `Unknown` for the reader to reject with context.
macro_rules! union_table {
    ($name:ident, $field:literal, $view:ident { $($tag:literal => $variant:ident($member:ident)),+ $(,)? }) => {
        pub(crate) struct $name;

        impl<'a> flatbuffers::Follow<'a> for $name {
            type Inner = View<'a, $name>;
            unsafe fn follow(buf: &'a [u8], loc: usize) -> Self::Inner {
                // SAFETY: forwarded contract of `Follow::follow`.
                View { table: unsafe { Table::new(buf, loc) }, marker: PhantomData }
            }
        }

        impl Verifiable for $name {
            fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
                v.visit_table(pos)?
                    .visit_union::<u8, _>(
                        concat!($field, "_type"),
                        slot(0),
                        $field,
                        slot(1),
                        false,
                        |tag, v, pos| match tag {
                            $($tag => v.verify_union_variant::<Tab<$member>>(stringify!($variant), pos),)+
                            _ => Ok(()),
                        },
                    )?
                    .finish();
                Ok(())
            }
        }

        // Members without fields (Null) carry a view nobody reads.
        #[allow(dead_code)]
        pub(crate) enum $view<'a> {
            /// Tag 0 (NONE) or no union at all.
            None,
            Unknown(u8),
            $($variant(View<'a, $member>),)+
        }

        impl<'a> View<'a, $name> {
            pub(crate) fn value(&self) -> $view<'a> {
                // SAFETY: the verifier checked the tag as u8 and the value as
                // the member table the tag names.
                unsafe {
                    let tag = self.table.get::<u8>(slot(0), Some(0)).unwrap_or(0);
                    match tag {
                        0 => $view::None,
                        $($tag => match self.table.get::<Tab<$member>>(slot(1), None) {
                            Some(m) => $view::$variant(m),
                            None => $view::None,
                        },)+
                        other => $view::Unknown(other),
                    }
                }
            }
        }
    };
}

union_table!(EValueT, "val", KernelTypesView {
    1 => Null(NullT),
    2 => Int(IntT),
    3 => Bool(BoolT),
    4 => Double(DoubleT),
    5 => Tensor(TensorT),
    6 => String(StringT),
    7 => IntList(IntListT),
    8 => DoubleList(DoubleListT),
    9 => BoolList(BoolListT),
    10 => TensorList(TensorListT),
    11 => OptionalTensorList(OptionalTensorListT),
});
union_table!(InstructionT, "instr_args", InstructionArgumentsView {
    1 => KernelCall(KernelCallT),
    2 => DelegateCall(DelegateCallT),
    3 => MoveCall(MoveCallT),
    4 => JumpFalseCall(JumpFalseCallT),
    5 => FreeCall(FreeCallT),
});

/// Verify `buf` as a `Program` flatbuffer and return its root.
pub(crate) fn root(buf: &[u8]) -> Result<View<'_, ProgramT>, InvalidFlatbuffer> {
    let opts = VerifierOptions::default();
    flatbuffers::root_with_opts::<ProgramT>(&opts, buf)
}
